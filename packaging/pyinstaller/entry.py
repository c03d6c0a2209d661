"""The single-file build's entry point: `localllm ARGS` as the installed command runs it.

localllm starts helper processes with `sys.executable -m MODULE ...` (the llama.cpp guard's probe,
quantize's workers) and `sys.executable -c CODE` (doctor's torch check). In a frozen build
sys.executable is this binary, not a Python, so it answers those two forms itself."""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "-m":
        sys.argv = [sys.argv[2], *sys.argv[3:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    elif len(sys.argv) >= 3 and sys.argv[1] == "-c":
        code, sys.argv = sys.argv[2], ["-c", *sys.argv[3:]]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    else:
        from localllm.cli import main as cli

        cli()


main()
