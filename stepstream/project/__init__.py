"""The project: the one file (``stepstream.toml``) that says which workflows a system runs, which agents
take their steps and where the services those agents call live, so that every command agrees on them.

``model`` (what the file may say, validated), ``files`` (where it is found, and how it becomes the settings
every command reads), ``agents`` (an agent built from its declaration).
"""
