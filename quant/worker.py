"""A quantizing worker process: `python -m localllm.quant.worker SRC [IMATRIX.npz]`.

Reads `NAME<TAB>TYPE` lines from stdin (every task up front), and for each, in order, writes the
tensor's output bytes to stdout as an 8-byte little-endian length and the bytes. The writer runs one
per core and reads their answers in the file's order: a worker blocks on its pipe until then, so
each holds at most one finished tensor. Ctrl-C is the parent's to handle: the parent ends them.
"""

from __future__ import annotations

import signal
import struct
import sys


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import localllm.quant as q
    from localllm.gguf_file import GGUFFile
    from localllm.quant.writer import quantized_bytes

    q.WORKERS = 1  # one process per core already
    out = sys.stdout.buffer
    imatrix = {}
    if len(argv) > 1:  # the importance matrix, tensor name → column weights
        import numpy as np

        with np.load(argv[1]) as z:
            imatrix = {k: z[k] for k in z.files}
    with GGUFFile(argv[0]) as f:
        for line in sys.stdin:
            name, type_name = line.rstrip("\n").split("\t")
            data = quantized_bytes(f, name, type_name, imatrix.get(name))
            out.write(struct.pack("<Q", len(data)))
            out.write(data)
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
