"""A scheduler without a configured name claims the lowest slot free on its host, so that its restart after a
crash carries the same transactional id (and fences what it left open) while schedulers side by side differ."""

from __future__ import annotations

import signal
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from scheduler.instance import NoFreeSlot, scheduler_instance

ROOT = Path(__file__).parent.parent


def test_schedulers_side_by_side_get_different_slots_and_a_freed_slot_is_taken_again(tmp_path: Path) -> None:
    with scheduler_instance(None, tmp_path, host="h") as first, scheduler_instance(None, tmp_path, host="h") as second:
        assert (first, second) == ("h-1", "h-2")
    with scheduler_instance(None, tmp_path, host="h") as again:
        assert again == "h-1"


def test_a_configured_name_is_used_as_given_and_claims_nothing(tmp_path: Path) -> None:
    with scheduler_instance("blue", tmp_path) as name:
        assert name == "blue"
        assert not (tmp_path / "instances").exists()


def test_a_sigkilled_scheduler_leaves_its_slot_to_its_restart(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from scheduler.instance import scheduler_instance\n"
         f"with scheduler_instance(None, Path({str(tmp_path)!r}), host='h') as name:\n"
         "    print(name, flush=True); time.sleep(600)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "h-1"
        with scheduler_instance(None, tmp_path, host="h") as beside:
            assert beside == "h-2", "a running scheduler's slot is not taken"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with scheduler_instance(None, tmp_path, host="h") as restarted:
            assert restarted == "h-1", "the killed scheduler's restart gets its name back"
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_host_name_is_made_fit_for_a_transactional_id(tmp_path: Path) -> None:
    with scheduler_instance(None, tmp_path, host="pod 7/é:x") as name:
        assert name == "pod_7_é_x-1"


def test_with_every_slot_held_the_claim_is_refused_naming_the_folder(tmp_path: Path) -> None:
    with ExitStack() as held:
        for _ in range(3):
            held.enter_context(scheduler_instance(None, tmp_path, host="h", slots=3))
        with pytest.raises(NoFreeSlot, match="instances"), scheduler_instance(None, tmp_path, host="h", slots=3):
            pass
