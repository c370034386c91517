"""Issue 31 (copied for session 14): tests/kernels/test_programmatic_launch.py::test_decode_is_the_same_with_and_without
20 times in a row per format, in one process (each call builds its model, loads twice, PDL off/on)."""
import json
import sys

sys.path.insert(0, "tests")  # the tests import helpers.* as pytest's rootdir conftest does
import tempfile
from pathlib import Path

from kernels import backend
from tests.kernels import test_programmatic_launch as t

out = {}
for fmt in ("gptq", "exl2"):
    passed = 0
    for i in range(20):
        with tempfile.TemporaryDirectory() as d:
            try:
                t.test_decode_is_the_same_with_and_without(fmt, Path(d), None)
                passed += 1
            except AssertionError as e:
                print(fmt, i, "FAILED", str(e)[:300], flush=True)
            finally:
                backend.set_programmatic_launch(True)
    out[fmt] = f"{passed}/20"
    print(fmt, out[fmt], flush=True)
json.dump(out, open(sys.argv[1], "w"))
