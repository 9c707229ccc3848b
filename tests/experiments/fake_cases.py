"""Case kinds that misbehave on purpose, for the GPU-check runner's tests (plug-in kinds)."""

import os
import time


def ok(params, ctx):
    return {"status": "ok", "value": params.get("value")}


def hang(params, ctx):
    time.sleep(3600)


def die(params, ctx):
    os._exit(3)


def raises(params, ctx):
    raise RuntimeError("broken on purpose")
