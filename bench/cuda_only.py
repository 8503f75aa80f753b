"""The tests CI skips for want of CUDA, alone: a pytest plugin, and a summary of their junit files.

    python -m pytest -p bench.cuda_only -p no:cacheprovider tests/ --junitxml=native.xml     # on the GPU machine
    python -m bench.cuda_only --summary native.xml async.xml                              # a markdown summary

Kept: every test with a skipif mark whose reason names CUDA, a GPU or NVIDIA (tests/test_fast_path.py's `cuda`
mark and the like), plus the tests that run on CUDA where there is one and on the CPU otherwise (EXTRA). Every
other test is deselected: CI runs those. On a machine without CUDA the kept tests are collected and skipped
(EXTRA ones run on the CPU): how the selection is checked there.
"""
from __future__ import annotations

import re
import sys

CUDA_REASON = re.compile(r"CUDA|GPU|NVIDIA", re.IGNORECASE)
# tests whose device is CUDA where there is one (no skip mark): the GPU machine runs them with Triton
EXTRA = ("tests/test_train_inprocess.py::test_fp8_blocks_with_different_scales_share_one_compiled_graph",)


def needs_cuda(item) -> bool:
    return any(CUDA_REASON.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if needs_cuda(item) or item.nodeid.split("[")[0].endswith(EXTRA)]
    dropped = [item for item in items if item not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def summary(paths: list[str]) -> str:
    """One line per junit file (passed / failed / errors / skipped, seconds), then each failure's first line."""
    import xml.etree.ElementTree as ET
    lines = ["| run | tests | passed | failed | errors | skipped | s |", "|---|---|---|---|---|---|---|"]
    details = []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as error:
            lines.append(f"| {path} | unreadable: {error} | | | | | |")
            continue
        suites = [root] if root.tag == "testsuite" else list(root)
        counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        seconds = sum(float(s.get("time", 0)) for s in suites)
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        lines.append(f"| {path} | {counts['tests']} | {passed} | {counts['failures']} | {counts['errors']} | "
                     f"{counts['skipped']} | {seconds:.0f} |")
        for case in root.iter("testcase"):
            for outcome in ("failure", "error"):
                node = case.find(outcome)
                if node is not None:
                    message = (node.get("message") or node.text or "").strip().splitlines()[:1]
                    details.append(f"- {path}: {outcome} {case.get('classname')}::{case.get('name')}: "
                                   f"{message[0][:300] if message else ''}")
    return "\n".join(lines + ([""] + details if details else []))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--summary"]:
        raise SystemExit(__doc__)
    print(summary(sys.argv[2:]))
