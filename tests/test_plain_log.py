"""`--noprogress` lines: the newest record of each followed metrics file, once per interval (or
one per multiple of N steps passed), and once more at the end; a rewritten (shorter) file is read
again from its start."""

import io
import json
import time

from launch import plain_log


def append(path, *records):
    with open(path, "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def test_prints_newest_record_per_interval_and_at_the_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    out = io.StringIO()
    with plain_log.PlainProgress([("pretrain", str(path), 10)], every_s=0.05, out=out):
        append(path, {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0})
        time.sleep(0.3)
        with open(path, "a") as f:
            f.write('{"step": 3, "loss"')  # torn: not read until complete
        time.sleep(0.2)
        with open(path, "a") as f:
            f.write(": 3.5}\n")
        append(path, {"step": 3, "eval_nll": 2.5})  # the same step: merged
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert "pretrain step 2/10 (20%): loss=4" in lines[0]
    assert "step 3/10 (30%): loss=3.5 eval_nll=2.5" in lines[1]


def test_a_rewritten_file_is_read_from_its_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append(path, *({"step": s, "loss": 1.0} for s in range(1, 30)))
    follower = plain_log._Follower("rl", str(path), None)
    follower.poll()
    assert follower.line().endswith("rl step 29: loss=1")
    path.write_text(json.dumps({"step": 4, "loss": 2.0}) + "\n")  # a resumed run truncates
    follower.poll()
    assert follower.line().endswith("rl step 4: loss=2")
    assert follower.line() is None  # nothing new


def test_step_mode_prints_one_line_per_multiple_passed(tmp_path):
    path = tmp_path / "metrics.jsonl"
    out = io.StringIO()
    with plain_log.PlainProgress([("rl", str(path), 12)], every_s=30, out=out, every_steps=4):
        # Records every 3 steps: 3, 6 (passes 4), 9 (passes 8), 12 (passes 12, the last).
        for step in (3, 6, 9):
            append(path, {"step": step, "loss": float(step)})
        append(path, {"step": 9, "eval_nll": 1.5}, {"step": 12, "loss": 12.0})
        time.sleep(1.5)  # step mode polls every second whatever --log_every_s says
    lines = out.getvalue().splitlines()
    steps = [line.split(" step ")[1].split("/")[0] for line in lines]
    assert steps == ["6", "9", "12"], lines
    assert "loss=9 eval_nll=1.5" in lines[1]  # complete: the later line of step 9 merged
