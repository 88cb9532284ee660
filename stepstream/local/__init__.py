"""Local orchestration: the processes of a whole system on one machine (``up``), each service's entry point
(``services``), starting and watching child processes (``processes``) and when to restart one (``restarts``).
"""
