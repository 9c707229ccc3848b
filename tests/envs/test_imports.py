"""Environments run on CPU-only hosts: importing them must not pull in JAX."""

import subprocess
import sys


def test_envs_do_not_import_jax():
    code = "import sys, composer_jax.envs; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
