"""The prepared GPU check (`experiments/gpu_check.py`): device data, plan, cases, runner, report."""
