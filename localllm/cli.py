"""The `localllm` command. It parses, calls the layers below and prints; nothing more.

Exit codes (PRODUCT.md): 0 success, 1 user error (one plain line on stderr, no traceback),
2 usage error, 130 interrupted. Heavy modules (torch, llama_cpp, textual) are imported inside the
commands that need them, never at module level: `localllm --help` must start fast.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

try:  # typer ≥ 0.26 carries its own copy of click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exc

from localllm import __version__, backends
from localllm.errors import LocalLLMError

app = typer.Typer(
    name="localllm",
    help="Run language models on your own machine.",
    add_completion=True,  # --install-completion / --show-completion: bash, zsh, fish (Typer's)
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print stable JSON instead of text.")]
# what an hour of this machine costs (bench, recommend): a price, or power at a price per kWh
GpuCostOption = Annotated[
    float | None, typer.Option("--gpu-cost-per-hour", help="USD an hour of this machine costs.")
]
WattsOption = Annotated[float | None, typer.Option("--watts", help="Power drawn (with --kwh-price).")]
KwhPriceOption = Annotated[float | None, typer.Option("--kwh-price", help="USD per kWh.")]
# every --backend flag names what the registry knows (importing it imports no backend)
BACKEND_HELP = f"Backend: {', '.join(backends.names())} (auto: the first that runs here)."
# llama.cpp's placement over GPUs (memory.plan; `show` prints the plan)
GpuLayersOption = Annotated[
    str, typer.Option("--gpu-layers", help="llama.cpp: layers on the GPU: auto (the planner's: the "
                      "most that fit with a margin), all, or a number (0: CPU only).")  # fmt: skip
]
TensorSplitOption = Annotated[
    str | None, typer.Option("--tensor-split", help="llama.cpp with several GPUs: each one's share "
                             "of the layers, e.g. 3,1 (default: by free memory).")  # fmt: skip
]
CpuMoeOption = Annotated[
    int | None, typer.Option("--cpu-moe", help="llama.cpp, MoE models: keep the experts of the "
                             "first N layers in RAM (default: the planner's).")  # fmt: skip
]
CompileFlag = Annotated[
    bool | None,
    typer.Option("--compile/--no-compile", help="torch engine: run decode steps as one compiled "
                 "call (default: on CUDA only; on the CPU it pays from the second start, once the "
                 "compiled kernels are cached under the store)."),
]


def version_lines() -> list[str]:
    """localllm's version, then the engines' as installed (package metadata: nothing imported,
    so a llama.cpp build that would crash this CPU cannot) and llama.cpp's build recipe."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from localllm.backends.llamacpp_guard import build_recipe, llamacpp_version

    def installed(dist: str) -> str | None:
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    lines = [f"localllm {__version__} (Python {platform.python_version()})"]
    llama = installed("llama-cpp-python")
    if llama is None:
        lines.append("llama-cpp-python: not installed (pip install 'localllm[llamacpp]')")
    else:
        flavour, args = build_recipe()
        source = llamacpp_version()
        llama += f", llama.cpp {source}" if source else ""
        if flavour == "unknown":
            lines.append(f"llama-cpp-python {llama} (llama.cpp build: pip's own, llama.cpp's default -march=native)")
        else:
            lines.append(f"llama-cpp-python {llama} (llama.cpp build: {flavour}, by scripts/llamacpp-build)")
            if args:
                lines.append(f"  CMake: {args}")
    torch = installed("torch")
    lines.append(f"torch {torch}" if torch else "torch: not installed (pip install 'localllm[torch]')")
    return lines


def _version(value: bool) -> None:
    if value:
        print("\n".join(version_lines()))
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    if ctx.invoked_subcommand is None:
        _open_app(None)


def _open_app(model: str | None, *, chat: bool = False) -> None:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise LocalLLMError(
            "the terminal app needs a terminal; see `localllm --help` for the commands"
        )
    from localllm.tui.app import run as run_app

    run_app(chat_model=model, chat=chat)


@app.command()
def tui() -> None:
    """Open the terminal app (same as `localllm` alone)."""
    _open_app(None)


@app.command()
def chat(
    model: Annotated[
        str | None, typer.Argument(help="Model to chat with (default: the default).")
    ] = None,
) -> None:
    """Open the terminal app straight in a chat."""
    _open_app(model, chat=True)


def _store():  # noqa: ANN202 - imported lazily to keep --help light
    from localllm.models_registry.store import Store

    return Store()


def _emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


@app.command("list")
def list_models(json_out: JsonFlag = False) -> None:
    """List local models: name, arch, params, quant, size, context."""
    from localllm.model_info import human_bytes, human_params

    records = _store().list()
    if json_out:
        _emit_json([_record_json(r) for r in records])
        return
    if not records:
        print("No local models. Try `localllm pull smollm2` or `localllm import FILE.gguf`.")
        return
    rows = [("NAME", "ARCH", "PARAMS", "QUANT", "SIZE", "CONTEXT", "SOURCE")]
    for r in records:
        i = r.info
        rows.append((r.name, i.architecture, human_params(i.parameters), i.quant,
                     human_bytes(r.size), str(i.context_length), r.source))  # fmt: skip
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _record_json(r: Any) -> dict[str, Any]:
    i = r.info
    return {
        "name": r.name,
        "digest": f"sha256:{r.digest}",
        "size": r.size,
        "source": r.source,
        "reference": r.ref,  # a file another tool owns (registered by --scan), else null
        "added": r.added,
        "architecture": i.architecture,
        "parameters": i.parameters,
        "quant": i.quant,
        "context_length": i.context_length,
        "projector": f"sha256:{r.projector}" if r.projector else None,  # a vision projector
    }


@app.command()
def show(
    model: Annotated[
        str, typer.Argument(help="Model name, e.g. smollm2 or smollm2:135m-instruct-q4_1.")
    ],
    ctx: Annotated[
        int | None, typer.Option("--ctx", help="Context length for the memory estimate.")
    ] = None,
    kv_cache: Annotated[
        str,
        typer.Option(
            "--kv-cache", help="KV cache type: f16, q8_0, q4_0, int8, fp8, int4, int2 or k=..,v=.."
        ),
    ] = "f16",
    devices_file: Annotated[
        Path | None,
        typer.Option("--devices", help="Plan for the machine a JSON file describes (a list of "
                     "devices: kind, name, total, free, bandwidth), not this one; as "
                     "LOCALLLM_DEVICES."),  # fmt: skip
    ] = None,
    gpu_layers: GpuLayersOption = "auto",
    tensor_split: TensorSplitOption = None,
    cpu_moe: CpuMoeOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Show a model's metadata, chat template, memory estimate, where its layers go and whether
    it fits."""
    from localllm.chat import template_for
    from localllm.devices import inventory
    from localllm.engine import sampling_defaults
    from localllm.gguf_file import GGUFFile
    from localllm.memory import estimate
    from localllm.model_info import human_bytes, human_params, model_info
    from localllm.models_registry.catalog import ensure_local, sampling_for
    from localllm.types import LoadOptions

    store = _store()
    record = ensure_local(model, store)
    path = store.path_of(record)
    with GGUFFile(path) as gf:
        info = model_info(gf)
        template = gf.get("tokenizer.chat_template")
        used = template_for(gf)  # what `run` renders with: the file's own, a family's, or plain
    options = LoadOptions(ctx=ctx, kv_cache=kv_cache, parallel=1, gpu_layers=gpu_layers,
                          tensor_split=tensor_split, cpu_moe=cpu_moe)  # checks all, in run's words
    machine = inventory(devices_file)
    backend = _backend_status("auto", path, options)  # e.g. an int4 cache: the torch engine
    try:
        spec = (backends.get(backend["name"]) if backend["available"]
                else backends.describe("auto", options))  # fmt: skip
        est, estimator = spec.estimate(info, options, devices=machine), spec.name
    except LocalLLMError:  # no backend to ask: llama.cpp's arithmetic
        est, estimator = estimate(info, ctx=ctx, kv_cache=kv_cache, devices=machine,
                                  placement=options.placement), "llama.cpp"  # fmt: skip
    sampling, sampling_source = sampling_defaults(path, sampling_for(record))
    from localllm.quant.report import load_report, report_table

    quality = load_report(store.home, record.digest)
    from localllm.engine.core import head_path
    from localllm.engine.drafts import head_info

    head = head_info(head_path(store.home, record.digest), record.digest)
    if json_out:
        _emit_json(
            _record_json(record)
            | {
                "quality": quality,
                "path": str(path),
                "info": info.to_dict(),
                "chat_template": template,
                "template": {"origin": used.origin, "note": used.note or None},
                "sampling_defaults": {"values": sampling, "source": sampling_source},
                "memory": est.to_dict(),
                "devices": machine.to_dict(),
                "backend": backend,
                "draft_head": head,
            }  # fmt: skip
        )
        return
    kv_heads = sorted(set(info.kv_heads))
    sampling_text = "the global defaults"
    if sampling:
        sampling_text = ", ".join(f"{k} {v}" for k, v in sampling.items())
        sampling_text += f" (from the {sampling_source})"
    facts = [
        ("name", record.name),
        ("model", info.name or "-"),
        ("architecture", info.architecture),
        ("parameters", f"{human_params(info.parameters)} ({info.parameters:,})"),
        ("quantization", info.quant),
        ("context length", f"{info.context_length:,}"),
        ("layers", str(info.n_layers)),
        ("embedding", str(info.n_embd)),
        ("heads", f"{info.n_heads} (KV heads {', '.join(map(str, kv_heads))})"),
        (
            "head dim",
            f"{info.head_dim_k}"
            + (f"/{info.head_dim_v}" if info.head_dim_v != info.head_dim_k else ""),
        ),
        ("vocabulary", f"{info.vocab_size:,}"),
        ("license", info.license or "-"),
        ("size", f"{human_bytes(record.size)} ({record.size:,} bytes)"),
        ("digest", f"sha256:{record.digest}"),
        ("source", record.source),
        ("file", str(path)),
        ("backend", f"{backend['name']} ({backend['reason']})" if backend["available"]
                    else f"none: {backend['reason']}"),  # fmt: skip
        ("can do", _capabilities_text(backend["capabilities"])),
        ("sampling", sampling_text),
        ("draft head", _head_text(head)),
    ]
    if info.sliding_window:
        facts.insert(8, ("sliding window", f"{info.sliding_window:,}"))
    for k, v in facts:
        print(f"  {k:<15} {v}")
    print()
    kv = est.type_k if est.type_k == est.type_v else f"k={est.type_k},v={est.type_v}"
    print(f"Memory at context {est.ctx:,}, KV cache {kv} ({estimator}, one sequence):")
    for label, n in (("weights", est.weights_bytes), ("KV cache", est.kv_bytes),
                     ("compute", est.compute_bytes)):  # fmt: skip
        print(f"  {label:<15} {human_bytes(n):>11}")
    verdict = "fits" if est.fits else "does NOT fit"
    if est.plan is None:
        print(f"  {'total':<15} {human_bytes(est.total_bytes):>11}   "
              f"{human_bytes(est.available_bytes)} available on {est.device}: {verdict}")  # fmt: skip
    else:
        print(f"  {'total':<15} {human_bytes(est.total_bytes):>11}   {verdict}")
    print()
    _print_placement(est, machine, info, options, estimator)
    if quality is not None:
        print(f"Quality ({quality.get('file_type') or 'quantized'}, measured {quality['when']}):")
        for label, value in report_table(quality):
            print(f"  {label:<15} {value}")
        print()
    if used.origin == "model file":
        print("Chat template (model file):")
        print(used.source.rstrip())
    else:
        print(f"Chat template: {used.origin} — {used.note}")


def _print_placement(est: Any, machine: Any, info: Any, options: Any, estimator: str) -> None:
    """`show`'s devices and, for llama.cpp, where the layers go (`memory.plan`)."""
    from localllm.memory import plan as place
    from localllm.model_info import human_bytes

    where = "described in " + machine.source if machine.source != "detected" else "this machine"
    print(f"Devices ({where}):")
    for d in machine.devices:
        bw = f", {d.bandwidth / 1e9:.0f} GB/s" if d.bandwidth else ""
        shared = ", shared with the GPU" if not d.gpu and any(g.unified for g in machine.gpus) else ""
        print(f"  {d.label:<15} {d.name}: {human_bytes(d.free_bytes)} free of "
              f"{human_bytes(d.total_bytes)}{bw}{shared}")  # fmt: skip
    plan = est.plan
    if plan is None and estimator == "llama.cpp":  # no GPU, or --device cpu: all in RAM
        plan = place(info, dataclasses.replace(machine, devices=(machine.cpu,)), ctx=options.ctx,
                     kv_cache=options.kv_cache, parallel=options.parallel)  # fmt: skip
    if plan is None:
        print()
        return
    print(f"Placement (llama.cpp, --gpu-layers {plan.request if plan.gpu_shares else 0}): "
          f"{plan.text()}")
    for s in plan.shares:
        room = f", {human_bytes(s.margin_bytes)} kept free" if s.margin_bytes else ""
        print(f"  {s.label:<15} {human_bytes(s.total_bytes):>11} of {human_bytes(s.free_bytes)} "
              f"free{room}: weights {human_bytes(s.weights_bytes)}, KV {human_bytes(s.kv_bytes)}, "
              f"compute {human_bytes(s.compute_bytes)}{'' if s.fits else '  DOES NOT FIT'}")  # fmt: skip
    flags = f"--gpu-layers {plan.gpu_layers}" if plan.gpu_shares else "--device cpu"
    if plan.cpu_moe:
        flags += f" --cpu-moe {plan.cpu_moe}"
    if len(plan.tensor_split) > 1:
        flags += " --tensor-split " + ",".join(f"{p:.2f}" for p in plan.tensor_split)
    rate = plan.decode_rate
    speed = (f"expected decode at most {rate:.0f} tokens/s (each weight read once per token at "
             f"each device's bandwidth)" if rate else "no expected rate: a device's bandwidth is "
             "unknown (give it in --devices)")  # fmt: skip
    print(f"  as llama.cpp flags: {flags}; {speed}")
    print()


def _head_text(head: dict[str, Any] | None) -> str:
    """`show`'s line on the model's draft head (`engine.drafts.head_info`)."""
    if head is None:
        return "none (`localllm train-draft` trains one)"
    if "error" in head:
        return str(head["error"])
    if head.get("source"):
        return f"published, from {head['source']}"
    return (f"trained on {head['tokens'] or 0:,} tokens in {(head['seconds'] or 0) / 60:.1f} min, "
            f"held-out agreement {head['agree'] or 0:.0%}")  # fmt: skip


def _capabilities_text(caps: dict[str, Any] | None) -> str:
    if not caps:
        return "-"
    return "; ".join([
        f"KV {' '.join(caps['kv_cache_types'])}",
        "context shift" if caps["streaming"] else "no context shift",
        f"speculative {', '.join(caps['speculative'])}",
        f"eviction {', '.join(caps['eviction'])}" if caps["eviction"] else "no eviction",
        "constrained decoding" if caps["grammar"] else "no constrained decoding",
        f"devices {', '.join(caps['devices'])}",
    ])  # fmt: skip


def _backend_status(name: str = "auto", path: Path | None = None,
                    options: Any = None) -> dict[str, Any]:  # fmt: skip
    """The backend `run` would use here for `path` (and load `options`: auto takes one that
    honours them), and why: what it can do (the registry says, nothing is imported), whether it
    runs (llama.cpp's probe runs once per build and machine, in a child) and whether it reads
    the file."""
    try:
        spec = backends.describe(name, options)
    except LocalLLMError as e:
        return {"name": None, "available": False, "reason": str(e), "capabilities": None,
                "summary": ""}  # fmt: skip
    status = {"name": spec.name, "capabilities": spec.capabilities.to_dict(), "summary": spec.summary}
    try:
        chosen, why = backends.select(name, path, options=options)
    except LocalLLMError as e:
        return status | {"available": False, "reason": str(e)}
    return status | {"name": chosen.name, "capabilities": chosen.capabilities.to_dict(),
                     "summary": chosen.summary, "available": True, "reason": why}  # fmt: skip


@app.command()
def pull(
    model: Annotated[
        str,
        typer.Argument(help="smollm2[:TAG], hf.co/ORG/REPO[:QUANT] or hf.co/ORG/REPO/FILE.gguf."),
    ],
    revision: Annotated[
        str | None,
        typer.Option("--revision", help="Hugging Face branch, tag or commit (default: main)."),
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Download a model with a progress bar; resumes; verifies sha256."""
    from localllm.model_info import human_bytes
    from localllm.models_registry.pull import pull as do_pull

    show = _PullProgress(quiet=json_out)
    try:
        with show:
            record = do_pull(model, revision=revision, on_progress=show.update)
    except KeyboardInterrupt:
        done = show.last.done if show.last else 0
        kept = f" ({human_bytes(done)} kept)" if done else ""
        print(f"pull interrupted{kept}: run `localllm pull {model}` again to resume",
              file=sys.stderr)  # fmt: skip
        raise typer.Exit(130) from None
    if json_out:
        _emit_json(_record_json(record))
    else:
        print(f"pulled {record.name} ({record.info.architecture}, {record.info.quant}, "
              f"{human_bytes(record.size)}) sha256:{record.digest}")  # fmt: skip


class _StderrBar:
    """A rich progress bar on stderr while it is a terminal (and not `--json`); subclasses give
    the columns and feed it in `update`."""

    transient = False

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty() and not quiet
        self.bar: Any = None
        self.task: Any = None

    def columns(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __enter__(self) -> Any:
        if self.tty:
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(*self.columns(), console=Console(stderr=True),
                                transient=self.transient)  # fmt: skip
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


class _PullProgress(_StderrBar):
    """A rich progress bar on a terminal; a few plain lines on stderr otherwise."""

    def __init__(self, quiet: bool) -> None:
        super().__init__(quiet)
        self.last: Any = None

    def columns(self) -> tuple[Any, ...]:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        return (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                TransferSpeedColumn(), TimeRemainingColumn())  # fmt: skip

    def update(self, e: Any) -> None:
        phase_changed = self.last is None or self.last.phase != e.phase
        self.last = e
        if self.bar is not None:
            if self.task is None and e.total:
                self.task = self.bar.add_task(e.name, total=e.total)
            if self.task is not None:
                self.bar.update(self.task, completed=e.done, total=e.total or None,
                                description=f"{e.name} {e.phase}")  # fmt: skip
            if (
                e.message
                and e.phase in ("waiting", "retrying", "done")
                or (e.message and e.phase == "downloading")
            ):
                self.bar.console.print(f"  {e.message}", style="dim")
        elif not self.quiet and (phase_changed or e.message) and e.phase != "done":
            text = f"{e.phase} {e.name}" + (f": {e.message}" if e.message else "")
            print(text, file=sys.stderr, flush=True)


@app.command()
def rm(
    model: Annotated[str, typer.Argument(help="Model name.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Remove a model from the store (its file goes when no other name uses it)."""
    from localllm.errors import ModelNotFound
    from localllm.models_registry.catalog import find_local

    store = _store()
    record = find_local(model, store)
    if record is None:
        raise ModelNotFound(f"model {model!r} is not in the store")
    if not yes:
        if not sys.stdin.isatty():
            raise LocalLLMError(f"not removing {record.name} without --yes (no terminal to ask)")
        if not typer.confirm(f"Remove {record.name}?", default=False):
            raise typer.Exit(1)
    store.remove(record.name)
    if record.ref:
        print(
            f"removed {record.name} (its file {record.ref} belongs to another tool: left in place)"
        )
    else:
        print(f"removed {record.name}")


@app.command("import")
def import_model(
    path: Annotated[
        Path | None, typer.Argument(help="A GGUF file to register.", show_default=False)
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Name to register it under.")] = None,
    scan: Annotated[
        bool,
        typer.Option("--scan", help="Find models in the Hugging Face cache, Ollama and LM Studio."),
    ] = False,
    mmproj: Annotated[
        Path | None,
        typer.Option("--mmproj", help="The model's vision projector (an mmproj GGUF): it reads "
                     "images. With --name and no PATH, given to a model already stored."),
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Register a GGUF file (hard link, no copy where possible), or --scan for other tools' models."""
    from localllm.model_info import human_bytes
    from localllm.models_registry.store import check_projector

    if mmproj is not None and path is None and name is not None and not scan:
        record = _store().add_projector(name, mmproj)
    else:
        if scan == (path is not None):
            raise click_exc.UsageError("give a PATH or --scan (not both)")
        if scan:
            if name is not None or mmproj is not None:
                raise click_exc.UsageError("--name and --mmproj go with PATH, not with --scan")
            return _import_scan(json_out)
        if mmproj is not None:
            check_projector(mmproj)  # before the model: a bad projector imports nothing
        record = _store().import_file(path, name)
        if mmproj is not None:
            record = _store().add_projector(record.name, mmproj)
    if json_out:
        _emit_json(_record_json(record))
        return
    vision = ", reads images" if record.projector else ""
    print(f"imported {record.name} ({record.info.architecture}, {record.info.quant}, "
          f"{human_bytes(record.size)}{vision})")  # fmt: skip


def _import_scan(json_out: bool) -> None:
    from localllm.models_registry.scan import register_found, scan

    results = register_found(_store(), scan())
    if json_out:
        _emit_json([r.to_dict() for r in results])
        return
    if not results:
        print("No GGUF models found in the Hugging Face cache, Ollama or LM Studio folders.")
        return
    for r in results:
        detail = f"  ({r.reason})" if r.reason else ""
        print(f"{r.status:<10}  {r.origin:<11}  {r.name or '-'}  {r.path}{detail}")
    counts = {s: sum(r.status == s for r in results) for s in ("registered", "already", "skipped")}
    print(f"{counts['registered']} registered by reference (no copies), {counts['already']} "
          f"already known, {counts['skipped']} skipped")  # fmt: skip


@app.command()
def doctor(
    deep: Annotated[
        bool,
        typer.Option("--deep", help="Probe llama.cpp afresh and re-hash every model (slow)."),
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Check Python, llama.cpp, torch, memory, disk, the store and settings; print fixes."""
    from localllm.doctor import run_checks, text_marks

    marks = text_marks(sys.stdout.encoding)
    show = None if json_out else (lambda c: print(c.line(marks), flush=True))
    report = run_checks(deep=deep, on_check=show)
    if json_out:
        _emit_json(report.to_dict())
    if not report.ok:
        names = ", ".join(c.name for c in report.failed)
        raise LocalLLMError(f"{len(report.failed)} of {len(report.checks)} checks failed: {names}")


def _print_stats(result: Any, llm: Any = None) -> None:
    if llm is not None:
        b = llm.runner
        extra = ""
        if b.name == "torch":
            extra = f" on {b.device}, {b.dtype}"
        print(f"backend {b.name}{extra}, loaded in {llm.load_s:.2f} s ({llm.backend_why})",
              file=sys.stderr)
    t, n = result.timings, result.usage.completion_tokens
    pps = result.usage.prompt_tokens / t.prompt_s if t.prompt_s else 0.0
    print(
        f"prompt {result.usage.prompt_tokens} tokens ({result.usage.cached_tokens} cached) at {pps:.1f} tokens/s; "
        f"TTFT {t.ttft_s * 1000:.0f} ms; {n} tokens, TPOT {t.tpot_s(n) * 1000:.1f} ms, "
        f"{t.tokens_per_s(n):.1f} tokens/s; finish {result.finish_reason}"
        + (
            f"; context shifted {result.context_shifts}x ({result.discarded_tokens} tokens dropped)"
            if result.context_shifts
            else ""
        ),
        file=sys.stderr,
    )
    sp = result.speculative
    if sp is not None:
        print(f"speculative {sp.mode}: {sp.accepted}/{sp.drafted} drafted tokens accepted "
              f"({sp.acceptance:.0%}) in {sp.rounds} of {sp.passes} passes, "
              f"{sp.tokens_per_pass:.2f} tokens per pass"
              + (f"; switched off: {sp.switched_off}" if sp.switched_off else ""),
              file=sys.stderr)  # fmt: skip


def _generate(llm: Any, request: Any, *, stream_out: bool, thinking: bool = True) -> Any:
    """Stream one request to stdout; Ctrl-C cancels it and raises KeyboardInterrupt once the
    stream has ended. A thinking model's reasoning comes first, between `Thinking...` and
    `...done thinking.` (dimmed on a terminal), unless `thinking` is False.

    While it runs, Ctrl-C only sets a flag and cancels the stream (a handler that never raises):
    a KeyboardInterrupt raised wherever the signal lands was lost when it landed in a fork
    callback (the chat template renders in a forked child; Python ignores exceptions raised in
    `os.register_at_fork` callbacks), and the answer ran on to its end."""
    import signal
    import threading

    from localllm.chat import ToolHold

    stopped = threading.Event()
    stream: Any = None

    def on_sigint(signum: int, frame: Any) -> None:
        stopped.set()
        if stream is not None:
            stream.cancel()

    handled = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if handled else None
    try:
        stream = llm.submit(request)
        if stopped.is_set():  # pressed while the request was being prepared
            stream.cancel()
        shown = _Thoughts(thinking and stream_out)
        hold = ToolHold(bool(request.messages) and bool(request.tools) and request.tool_choice != "none")
        for chunk in stream:
            if stream_out and not stopped.is_set():
                text = hold.feed(chunk.text)  # a tool call's markup is never printed
                out = shown.feed(chunk.reasoning) + shown.end(text) + text
                if out:
                    sys.stdout.write(out)
                    sys.stdout.flush()
        if stream_out and shown.open:
            sys.stdout.write(shown.end("."))
        if stream_out and stream.result is not None and not stopped.is_set():
            sys.stdout.write(hold.rest(stream.result.text, bool(stream.result.tool_calls)))
    finally:
        if handled:
            signal.signal(signal.SIGINT, previous)
    if stream_out:
        print(flush=True)
    if stopped.is_set():
        raise KeyboardInterrupt
    return stream.result


def _read_image(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise LocalLLMError(f"cannot read the image {path}: {e.strerror or e}") from None
    if len(data) > 64 << 20:
        raise LocalLLMError(f"the image {path} is over 64 MiB")
    return data


class _Thoughts:
    """Reasoning as `run` prints it: opened by `Thinking...`, closed by `...done thinking.`."""

    def __init__(self, show: bool) -> None:
        self.show, self.open = show, False
        tty = sys.stdout.isatty()
        self.dim, self.plain = ("\x1b[2m", "\x1b[0m") if tty else ("", "")

    def feed(self, text: str) -> str:
        if not (self.show and text):
            return ""
        start = "" if self.open else f"{self.dim}Thinking...\n"
        self.open = True
        return start + text

    def end(self, answer: str) -> str:
        if not (self.open and answer):
            return ""
        self.open = False
        return f"\n...done thinking.{self.plain}\n\n"


@app.command()
def run(
    model: Annotated[str, typer.Argument(help="Model name, e.g. smollm2.")],
    prompt: Annotated[
        str | None,
        typer.Argument(help="The prompt; read from stdin when absent (REPL on a terminal)."),
    ] = None,
    backend: Annotated[str, typer.Option("--backend", help=BACKEND_HELP)] = "auto",
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.")] = "auto",
    dtype: Annotated[
        str,
        typer.Option("--dtype", help="torch engine's working precision: auto, f32 (exact), bf16, "
                     "f16 (on the CPU: fp16 weights, f32 sums) or int4 (the CPU's default: f16 "
                     "with the file's 4-bit feed-forward matrices kept 4-bit; on a GPU: bf16 with "
                     "every 4-bit matrix kept 4-bit)."),
    ] = "auto",
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", help="Most tokens to generate.")
    ] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", help="0 is greedy.")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k")] = None,
    min_p: Annotated[float | None, typer.Option("--min-p")] = None,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    system: Annotated[str | None, typer.Option("--system", help="System prompt.")] = None,
    ctx: Annotated[int | None, typer.Option("--ctx", help="Context length.")] = None,
    kv_cache: Annotated[
        str, typer.Option("--kv-cache", help="KV cache type (llama.cpp: f16, q8_0, q4_0, ...; torch: "
                          "f16, int8, fp8, int4, int2) or k=TYPE,v=TYPE.")
    ] = "f16",
    streaming: Annotated[
        str | None,
        typer.Option("--streaming", help="SINKS:WINDOW: shift the context instead of refusing."),
    ] = None,
    evict: Annotated[
        str | None, typer.Option("--evict", help="h2o:BUDGET: evict KV entries (where the backend can).")
    ] = None,
    speculative: Annotated[
        str | None, typer.Option("--speculative", help="off, lookup, self or draft:MODEL.")
    ] = None,
    compile_step: CompileFlag = None,
    gpu_layers: GpuLayersOption = "auto",
    tensor_split: TensorSplitOption = None,
    cpu_moe: CpuMoeOption = None,
    json_schema: Annotated[
        Path | None, typer.Option("--json-schema", help="Constrain output to a JSON schema.")
    ] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as-is, without the chat template.")
    ] = False,
    stats: Annotated[
        bool, typer.Option("--stats", help="Print TTFT, TPOT and tokens/s to stderr.")
    ] = False,
    think: Annotated[
        bool | None,
        typer.Option("--think/--no-think", help="A thinking model thinks, or not (default: the "
                     "model's own); --think on a model that cannot is refused."),  # fmt: skip
    ] = None,
    hide_thinking: Annotated[
        bool, typer.Option("--hidethinking", help="Do not print a thinking model's reasoning.")
    ] = False,
    image: Annotated[
        list[Path] | None,
        typer.Option("--image", help="An image (PNG, JPEG, GIF or BMP) for the first message; "
                     "repeat for more. The model needs its vision projector (import --mmproj)."),
    ] = None,
    local: Annotated[
        bool,
        typer.Option("--local", help="Load the model in this process even while `localllm serve` "
                     "runs (by default a running server's copy answers when it suits the options)."),
    ] = False,
    mcp: Annotated[
        Path | None,
        typer.Option("--mcp", help="An mcp.json (Claude Desktop / LM Studio format) whose servers' tools "
                     "the REPL offers the model, asking before each call (default: mcp.json in "
                     "LOCALLLM_HOME, when there is one)."),
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Chat with a model: the prompt is a user message rendered with the model's chat template.

    While `localllm serve` runs on this machine, its copy of the model answers (one copy in memory,
    one prefix cache) unless --local is given or an engine option differs from the server's."""
    from localllm.engine import check_supported
    from localllm.types import LoadOptions, Request, SamplingParams

    # `run` decodes one sequence at a time: no memory is set aside for more (PRODUCT: --parallel
    # is for `serve`). What the backend cannot do (--evict, --speculative, a KV type) is refused
    # by load() in the backend's words, before anything loads.
    options = LoadOptions(backend=backend, device=device, dtype=dtype, ctx=ctx, kv_cache=kv_cache,
                          streaming=streaming, evict=evict, speculative=speculative, parallel=1,
                          compile=compile_mode(compile_step), gpu_layers=gpu_layers,
                          tensor_split=tensor_split, cpu_moe=cpu_moe)  # fmt: skip
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
             "seed": seed, "max_tokens": max_tokens}  # fmt: skip
    SamplingParams.from_kwargs(**given)  # a bad value is one line before the model loads
    response_format = _json_schema_format(json_schema) if json_schema is not None else None
    if response_format is not None:  # refused by the engine's own check, before loading
        spec = backends.describe(options.backend, options)
        check_supported(Request(prompt="", response_format=response_format),
                        spec.capabilities, spec.name)  # fmt: skip
    interactive = prompt is None and sys.stdin.isatty()
    if mcp is not None and not interactive:
        raise LocalLLMError("--mcp needs the interactive REPL (each tool call is asked for): run without a "
                            "prompt on a terminal")  # fmt: skip
    if prompt is None and not interactive:
        prompt = sys.stdin.read()
    from localllm.home import default_home
    from localllm.repl import Chat, Lines

    def generate(llm: Any, request: Request) -> Any:
        result = _generate(llm, request, stream_out=not json_out, thinking=not hide_thinking)
        if stats:
            _print_stats(result, llm)
        return result

    def open_model(name: str, opts: LoadOptions) -> Any:  # the REPL's /load and num_ctx too
        from localllm.remote import open_model

        return open_model(name, opts, local=local,
                          say=None if json_out else lambda why: print(f"note: {why}", file=sys.stderr))  # fmt: skip

    images = [_read_image(p) for p in image or ()]  # a missing file is one line before loading
    chat = Chat(open_model(model, options), options, open_model, generate, system=system, raw=raw,
                sampling={k: v for k, v in given.items() if v is not None},
                response_format=response_format, think=think, images=images)  # fmt: skip
    try:
        note = getattr(getattr(chat.llm.backend, "chat_template", None), "note", "")
        if note and not raw and not json_out:
            print(f"note: {note}", file=sys.stderr)
        if not interactive:
            result = generate(chat.llm, chat.request(prompt or ""))
            if json_out:
                _emit_json(result.to_dict() | {"model": chat.llm.name})
            return
        chat.toolbox = _toolbox(mcp if mcp is not None else default_home() / "mcp.json", mcp is not None)
        where = f", served by {chat.llm.url}" if hasattr(chat.llm, "url") else ""
        print(f"{chat.llm.name} (context {chat.llm.n_ctx}{where}). /? for help, /bye or Ctrl-D to leave, "
              'Ctrl-C stops an answer, """ begins and ends a multi-line message.', file=sys.stderr)  # fmt: skip
        chat.loop(Lines.terminal(default_home() / "repl_history.jsonl"))
    finally:
        if chat.toolbox is not None:
            chat.toolbox.close()
        chat.llm.close()


def _toolbox(path: Path, named: bool) -> Any:
    """The MCP tools of `path` for the REPL (None when there is no such file and none was named);
    a server that does not start is one line, the others' tools are offered."""
    if not named and not path.is_file():
        return None
    from localllm.mcp_tools import Toolbox

    box = Toolbox.from_file(path)
    for line in box.errors:
        print(f"note: {line}", file=sys.stderr)
    names = [t["function"]["name"] for t in box.tools()]
    print(f"MCP tools from {path.name}: {', '.join(names) or 'none'} (each call is asked for)", file=sys.stderr)
    return box


@app.command()
def tune(
    model: Annotated[str, typer.Argument(help="Model name, e.g. smollm2.")],
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="torch engine's working precision.")] = "auto",
    json_out: JsonFlag = False,
) -> None:
    """Search the layers `--speculative self` skips and how far it drafts, by measured tokens/s on
    this machine; print the table searched and keep the choice for this model and device. Where
    the model has a draft head, measure too whether it drafts trees or a chain here."""
    from localllm.engine import load
    from localllm.engine import tune as tuning

    say = None if json_out else (lambda line: print(line, flush=True))
    head = None
    with load(model, backend="torch", device=device, dtype=dtype, ctx=512, parallel=1) as llm:
        config = tuning.tune(llm, report=say)
        key = tuning.device_key(llm)
        if llm.tuned_path is not None:
            tuning.save(llm.tuned_path, key, config)
        if llm.resolve("auto") == "head":
            head = tuning.tune_head(llm, report=say)
            if llm.tuned_path is not None:
                tuning.save(llm.tuned_path, key + "/head", head)
    if json_out:
        from dataclasses import asdict

        _emit_json({"model": llm.name, "device": key, **asdict(config), "head": head})
        return
    if config.pays:
        print(f"chosen: skip {len(config.skip)} layers {list(config.skip)}, draft {config.k} tokens: "
              f"{config.speedup:.2f}x of plain decoding (agreement {config.acceptance:.2f})")  # fmt: skip
    else:
        print("chosen: none — no skip set beat plain decoding here, so --speculative self decodes "
              "plainly on this model and device")  # fmt: skip


ANSWER_TOKENS = 60_000  # train-draft's self-distillation: answer tokens (about 6 min with llama.cpp)


@app.command("train-draft")
def train_draft(
    model: Annotated[str, typer.Argument(help="Model name, e.g. smollm2.")],
    text: Annotated[
        list[Path] | None,
        typer.Option("--text", help="A UTF-8 text file to train on as well (repeatable)."),
    ] = None,
    minutes: Annotated[
        float, typer.Option("--minutes", help="The whole run: writing the answers, then training.")
    ] = 30.0,
    tokens: Annotated[
        int | None, typer.Option("--tokens", help="Stop after this many training tokens, in all.")
    ] = None,
    source: Annotated[
        str | None, typer.Option("--from", help="Take a published EAGLE head instead of training "
                                 "one: hf.co/ORG/REPO or a folder (config.json, model.safetensors).")  # fmt: skip
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Train a draft head for `--speculative head` on this machine (EAGLE-style: one small layer
    on the model's own features), from its answers to built-in prompts and any --text files. It
    is kept beside the model; run again to go on where a stopped run left off. With --from, the
    head its authors published for this model is kept instead."""
    import time

    from localllm.engine import load
    from localllm.engine.core import head_path
    from localllm.engine.drafts import keep_text, kept_text, training_text
    from localllm.models_registry.catalog import ensure_local

    if (tokens is not None and tokens < 1) or minutes <= 0:
        raise LocalLLMError("--tokens and --minutes must be above 0")
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if not json_out else None
    t0 = time.monotonic()
    store = _store()
    record = ensure_local(model, store)
    head = head_path(store.home, record.digest)
    if source is not None:
        out = _published_head(source, record, head, store, json_out)
        if json_out:
            _emit_json({"model": record.name, "path": str(out), "from": source})
        else:
            print(f"{record.name}: draft head from {source} kept at {out}")
        return
    saved = head.with_name(head.stem + ".text.json")  # the text of a run in progress
    kept = kept_text(saved, record.digest) if head.with_name(head.name + ".partial").exists() else None
    if kept is not None:
        ids, writing = kept
        if say is not None:
            say(f"going on with the stopped run's text ({len(ids):,} tokens)")
    else:
        # the model's own answers, at most a third of the run: written by llama.cpp where it
        # runs here (about twice the torch engine's rate on a CPU), else by the torch engine
        budget = ANSWER_TOKENS if tokens is None else tokens // 2
        until = t0 + 60 * minutes / 3
        try:
            writer = load(model, backend="llama.cpp", ctx=1024, parallel=8)
        except LocalLLMError:
            writer = load(model, backend="torch", ctx=1024, parallel=4)
        with writer as llm:
            ids = training_text(llm, text or [], budget, say=say, until=until)
        writing = time.monotonic() - t0
        keep_text(saved, record.digest, ids, writing)
    last: list[Any] = []

    def progress(p: Any) -> None:
        last[:] = [p]
        if say is not None and not p.done:
            rate = p.tokens / p.seconds if p.seconds else 0.0
            agree = f" · held-out agreement {p.agree:.0%}" if p.agree is not None else ""
            print(f"\rstep {p.step} · {p.tokens:,} tokens · {rate:,.0f} tokens/s · loss "
                  f"{p.loss:.3f} · KL {p.kl:.3f}{agree}   ", end="", file=sys.stderr, flush=True)  # fmt: skip

    train_minutes = max(minutes - writing / 60, minutes / 10)
    with load(model, backend="torch", ctx=512, parallel=1) as llm:
        out = llm.run_here(lambda: llm.runner.train_draft_head(
            ids, llm.head_path, digest=llm.digest, minutes=train_minutes, tokens=tokens, report=progress))
    saved.unlink(missing_ok=True)
    p = last[0]
    if json_out:
        _emit_json({"model": llm.name, "path": str(out), "steps": p.step, "tokens": p.tokens,
                    "seconds": round(p.seconds + writing, 1), "training_seconds": round(p.seconds, 1),
                    "text_tokens": len(ids), "agreement": p.agree})  # fmt: skip
        return
    print(file=sys.stderr)
    print(f"{llm.name}: draft head trained on {p.tokens:,} tokens in {p.seconds / 60:.1f} min (and "
          f"{writing / 60:.1f} min writing its text); held-out agreement with the model's next "
          f"token {p.agree:.0%}; kept at {out}")  # fmt: skip


def _published_head(source: str, record: Any, out: Path, store: Any, quiet: bool) -> Path:
    """A published EAGLE-1 or EAGLE-3 head (a folder, or a hub repo fetched and verified as pulls are) for
    the model of `record`, checked against it and kept where `train-draft` keeps heads."""
    from localllm.backends.torch.train_draft import load_published, read_published, save_head
    from localllm.models_registry.pull import fetch_files

    info = record.info
    folder = Path(source).expanduser()
    if folder.is_dir():
        head = load_published(folder, info.vocab_size, info.n_layers)
    else:  # its config first: a head for another model is refused before its weights come
        with _PullProgress(quiet=quiet) as show:
            (config,) = fetch_files(source, ["config.json"], store=store, on_progress=show.update)
        try:
            c = json.loads(config.read_text(encoding="utf-8"))
            width = c.get("target_hidden_size") or c.get("hidden_size")
        except (OSError, ValueError, AttributeError):
            width = None  # read_published says what is wrong with it
        try:
            if isinstance(width, int) and width != info.n_embd:
                raise LocalLLMError(f"{source}: a head for a model of width {width}, but "
                                    f"{record.name}'s is {info.n_embd}")  # fmt: skip
            with _PullProgress(quiet=quiet) as show:
                (weights,) = fetch_files(source, ["model.safetensors"], store=store,
                                         on_progress=show.update)  # fmt: skip
            try:
                head = read_published(config, weights, info.vocab_size, source, info.n_layers)
            finally:
                weights.unlink(missing_ok=True)
        finally:
            config.unlink(missing_ok=True)
    width = head.config.get("target_dim", head.dim)
    if width != info.n_embd:
        raise LocalLLMError(f"{source}: a head for a model of width {width}, but {record.name}'s "
                            f"is {info.n_embd}")  # fmt: skip
    return save_head(head, out, record.digest, source=source)


@app.command("eval")
def eval_text(
    model: Annotated[str, typer.Argument(help="Model name, e.g. smollm2.")],
    text: Annotated[Path, typer.Option("--text", help="A UTF-8 text file to evaluate on.")],
    limit: Annotated[
        int | None, typer.Option("--limit", help="Evaluate the first TOKENS tokens (default: all).")
    ] = None,
    ctx: Annotated[int | None, typer.Option("--ctx", help="Context length (default: the text's).")] = None,
    backend: Annotated[str, typer.Option("--backend", help=BACKEND_HELP)] = "auto",
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="torch engine's working precision.")] = "auto",
    kv_cache: Annotated[
        str, typer.Option("--kv-cache", help="KV cache type, or k=TYPE,v=TYPE (torch: int8, fp8, "
                          "int4, int2 too).")  # fmt: skip
    ] = "f16",
    streaming: Annotated[
        str | None, typer.Option("--streaming", help="SINKS:WINDOW: StreamingLLM's cache.")
    ] = None,
    evict: Annotated[str | None, typer.Option("--evict", help="h2o:BUDGET (torch).")] = None,
    ref: Annotated[
        str | None, typer.Option("--ref", help="A reference model for KL and top-1 agreement.")
    ] = None,
    ref_kv: Annotated[
        str | None, typer.Option("--ref-kv", help="Reference: this model with this KV cache type.")
    ] = None,
    speculative: Annotated[
        str | None, typer.Option("--speculative", help="lookup, self or draft:MODEL: how often "
                                 "its draft is the model's choice on the text.")  # fmt: skip
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Perplexity over a text, evaluated as generation runs; KV-cache cost; KL and top-1
    agreement against a reference cache type (--ref-kv) or model (--ref)."""
    from localllm.evaluate import evaluate, read_text
    from localllm.memory import parse_kv_cache
    from localllm.model_info import human_bytes
    from localllm.types import LoadOptions

    options = LoadOptions(backend=backend, device=device, dtype=dtype, ctx=ctx, kv_cache=kv_cache,
                          streaming=streaming, evict=evict, speculative=speculative,
                          parallel=1)  # fmt: skip
    if ref_kv is not None:
        parse_kv_cache(ref_kv)
    if limit is not None and limit < 2:
        raise LocalLLMError(f"--limit must be at least 2 tokens, got {limit}")
    body = read_text(text)
    with _EvalProgress(quiet=json_out) as bar:
        result = evaluate(model, body, options=options, limit=limit, ref=ref, ref_kv=ref_kv,
                          progress=bar.update)  # fmt: skip
    if json_out:
        _emit_json(result)
        return
    r = result
    print(f"{r['model']}  perplexity {r['perplexity']:.4f} over {r['tokens']:,} tokens "
          f"({r['backend']}, KV {r['kv_cache']}"
          + (f", streaming {r['streaming']}" if r["streaming"] else "")
          + (f", evict {r['evict']}" if r["evict"] else "") + f"; {r['evaluated']})")  # fmt: skip
    print(f"KV cache: {r['kv_bytes_per_token']:,.0f} bytes per token; residual "
          f"{human_bytes(r['kv_residual_bytes'])}; peak {human_bytes(r['kv_peak_bytes'])}")
    if "kl_mean" in r:
        print(f"against {r['reference']['model']} with KV {r['reference']['kv_cache']}: "
              f"KL mean {r['kl_mean']:.5f} nats, p99 {r['kl_p99']:.5f}; "
              f"top-1 agreement {100 * r['top1_agreement']:.2f}%")
    sp = r.get("speculative")
    if sp:
        print(f"speculative {sp['mode']}: " + (sp.get("note") or
              f"a draft at {100 * sp['coverage']:.1f}% of positions; its first token is the model's "
              f"choice {100 * sp['acceptance']:.1f}% of the time (α); "
              f"{sp['tokens_per_pass']:.2f} tokens per pass predicted at k={sp['k']}"))  # fmt: skip
    print(f"{r['seconds']:.1f} s")


@app.command()
def bench(
    model: Annotated[
        str | None, typer.Argument(help="Model name (with --url: the server's, default its first).")
    ] = None,
    url: Annotated[
        str | None, typer.Option("--url", help="A running server (OpenAI or Ollama API) to measure.")
    ] = None,
    api: Annotated[str, typer.Option("--api", help="With --url: auto, openai or ollama.")] = "auto",
    api_key: Annotated[str | None, typer.Option("--api-key", help="With --url: its API key.")] = None,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Tokens per prompt.")] = 128,
    gen_tokens: Annotated[int, typer.Option("--gen-tokens", help="Tokens generated per request.")] = 64,
    concurrency: Annotated[
        str, typer.Option("--concurrency", help="Clients at once, one level or several: 1,2,4,8.")
    ] = "1",
    requests: Annotated[
        int | None, typer.Option("--requests", help="Requests per level (default: 2 × clients, >= 4).")
    ] = None,
    backend: Annotated[str, typer.Option("--backend", help=BACKEND_HELP)] = "auto",
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="torch engine's working precision.")] = "auto",
    kv_cache: Annotated[str, typer.Option("--kv-cache", help="KV cache type, or k=TYPE,v=TYPE.")] = "f16",
    speculative: Annotated[
        str | None, typer.Option("--speculative", help="off, lookup, self or draft:MODEL.")
    ] = None,
    gpu_cost_per_hour: GpuCostOption = None,
    watts: WattsOption = None,
    kwh_price: KwhPriceOption = None,
    json_out: JsonFlag = False,
) -> None:
    """TTFT, TPOT and latency percentiles, throughput at each concurrency, cost per million
    tokens, and the decode ceiling of this machine's memory bandwidth."""
    from localllm.bench import Price, run_bench
    from localllm.types import LoadOptions

    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise LocalLLMError(f"--concurrency takes numbers separated by commas, not {concurrency!r}") from None
    price = Price.of(gpu_cost_per_hour, watts, kwh_price)
    options = None
    if url is None:
        options = LoadOptions(backend=backend, device=device, dtype=dtype, kv_cache=kv_cache,
                              speculative=speculative)  # fmt: skip
    with _BenchProgress(quiet=json_out) as bar:
        report = run_bench(model, options=options, url=url, api=api, api_key=api_key,
                           prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, concurrency=levels,
                           requests=requests, price=price, progress=bar.update)  # fmt: skip
    if json_out:
        _emit_json(report)
        return
    _print_bench(report)


def _print_bench(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from localllm.model_info import human_bytes

    where = (f"{r['url']} ({r['api']} API)" if r["target"] == "server"
             else f"{r['backend']} on {r['device']}, KV {r['kv_cache']}"
             + (f", speculative {r['speculative']}" if r.get("speculative") else ""))  # fmt: skip
    print(f"{r['model']}  {where}; {r['prompt_tokens']} prompt + {r['gen_tokens']} generated tokens a request")
    if "memory_bandwidth_bytes_per_s" in r:
        bw = r["memory_bandwidth_bytes_per_s"]
        print(f"memory bandwidth {bw / 1e9:.1f} GB/s (probe); a decode step reads "
              f"{human_bytes(r['weights_bytes_per_token'])} of weights + "
              f"{human_bytes(r['kv_bytes_per_token'])} of KV per cached token and sequence")
    ms = lambda d: f"{1000 * d['p50']:.0f} / {1000 * d['p95']:.0f} / {1000 * d['p99']:.0f}"  # noqa: E731
    table = Table(title=None, show_lines=False)
    for col in ("clients", "TTFT ms p50/95/99", "TPOT ms p50/95/99", "e2e s p50/99", "out tok/s",
                "prompt tok/s", "prefill tok/s", "decode tok/s"):  # fmt: skip
        table.add_column(col, justify="right")
    has_ceiling = any("ceiling_tokens_per_s" in lv for lv in r["levels"])
    has_price = r.get("price") is not None
    if has_ceiling:
        table.add_column("% of ceiling", justify="right")
    if has_price:
        table.add_column("USD/M out", justify="right")
        table.add_column("USD/M in", justify="right")
    for lv in r["levels"]:
        row = [str(lv["concurrency"]), ms(lv["ttft_s"]), ms(lv["tpot_s"]),
               f"{lv['e2e_s']['p50']:.2f} / {lv['e2e_s']['p99']:.2f}", f"{lv['output_tokens_per_s']:.1f}",
               f"{lv['prompt_tokens_per_s']:.0f}", f"{lv['prefill_tokens_per_s']:.0f}",
               f"{lv['decode_tokens_per_s']:.1f}"]  # fmt: skip
        if has_ceiling:
            row.append(f"{100 * lv['ceiling_fraction']:.0f}% of {lv['ceiling_tokens_per_s']:.0f}")
        if has_price:
            row += [_usd(lv.get("usd_per_million_output")), _usd(lv.get("usd_per_million_input"))]
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 200).print(table)  # a pipe gets whole lines
    print("prompt tok/s: one request's, from its slot to its first token (median); prefill tok/s: "
          "the machine's, all prompt tokens over the time any prompt was being processed")
    if has_price:
        print(f"price: {r['price']['basis']}; input is priced at the prefill rate")


@app.command()
def recommend(
    max_ttft: Annotated[float | None, typer.Option("--max-ttft", help="Seconds: TTFT p95 at most.")] = None,
    min_tokens_per_s: Annotated[
        float | None, typer.Option("--min-tokens-per-s", help="Decode tokens/s at least.")
    ] = None,
    max_memory: Annotated[float | None, typer.Option("--max-memory", help="GB the model may use.")] = None,
    quality_text: Annotated[
        Path | None, typer.Option("--quality-text", help="Text to judge quality on (default: built in).")
    ] = None,
    quality_chars: Annotated[
        int, typer.Option("--quality-chars", help="Characters of it to evaluate.")
    ] = 2000,
    model: Annotated[
        list[str] | None, typer.Option("--model", help="Compare only these local models (repeatable).")
    ] = None,
    backend: Annotated[str, typer.Option("--backend", help="all (every one here), or one backend.")] = "all",
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Speed: tokens per prompt.")] = 128,
    gen_tokens: Annotated[int, typer.Option("--gen-tokens", help="Speed: tokens generated.")] = 32,
    gpu_cost_per_hour: GpuCostOption = None,
    watts: WattsOption = None,
    kwh_price: KwhPriceOption = None,
    json_out: JsonFlag = False,
) -> None:
    """Which local model and settings meet the targets here: measured (speed, quality, memory),
    kept for the next run, ranked by quality and cost."""
    from localllm.bench import Price
    from localllm.evaluate import read_text
    from localllm.recommend import Targets
    from localllm.recommend import recommend as run_recommend

    for name, v in (("--max-ttft", max_ttft), ("--min-tokens-per-s", min_tokens_per_s), ("--max-memory", max_memory)):
        if v is not None and not v > 0:
            raise LocalLLMError(f"{name} must be > 0, got {v}")
    if quality_chars < 100:
        raise LocalLLMError(f"--quality-chars must be at least 100, got {quality_chars}")
    targets = Targets(max_ttft, min_tokens_per_s, None if max_memory is None else max_memory * 1e9)
    price = Price.of(gpu_cost_per_hour, watts, kwh_price)
    text = read_text(quality_text) if quality_text is not None else None
    say = None if json_out else (lambda line: print(line, file=sys.stderr, flush=True))
    report = run_recommend(targets, backend=backend, quality_text=text, quality_chars=quality_chars,
                           prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, price=price,
                           models=model, progress=say)  # fmt: skip
    if json_out:
        _emit_json(report)
        return
    _print_recommend(report)


def _print_recommend(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from localllm.model_info import human_bytes

    has_price = r.get("price") is not None
    table = Table()
    for col in ("", "model", "setting", "memory", "TTFT p95 s", "tok/s", "bits/char", "PPL",
                "KL vs best", "top-1"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("model", "setting") else "right")
    if has_price:
        table.add_column("USD/M out", justify="right")
    table.add_column("misses")
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    for i, row in enumerate(r["rows"], 1):
        setting = f"{row['backend']}, KV {row['kv_cache']}" + (
            f", {row['speculative']}" if row["speculative"] != "off" else "")  # fmt: skip
        cells = [f"{i}." if row["meets"] else "✗", row["model"], setting, human_bytes(row["memory_bytes"]),
                 f(row.get("ttft_p95_s"), ".2f"), f(row.get("tokens_per_s"), ".1f"),
                 f(row.get("bits_per_char"), ".3f"), f(row.get("perplexity"), ".2f"),
                 f(row.get("kl_mean"), ".4f"),
                 "-" if row.get("top1_agreement") is None else f"{100 * row['top1_agreement']:.1f}%"]  # fmt: skip
        if has_price:
            cells.append(_usd(row.get("usd_per_million_output")))
        cells.append("; ".join(row["misses"]) or "")
        table.add_row(*cells)
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    met = [row for row in r["rows"] if row["meets"]]
    if met:
        best = met[0]
        print(f"recommended: {best['model']} with --backend {best['backend']} --kv-cache {best['kv_cache']}"
              + (f" --speculative {best['speculative']}" if best["speculative"] != "off" else ""))  # fmt: skip
    else:
        print("no local model and setting meets every target here")
    print(f"quality on {r['quality_chars']:,} characters of the {r['quality_text']} text; speed at one "
          f"client, {r['prompt_tokens']} prompt + {r['gen_tokens']} generated tokens; numbers kept "
          "in the store for the next run")  # fmt: skip


def _usd(v: float | None) -> str:
    return "-" if v is None else (f"{v:.2f}" if v >= 0.01 else f"{v:.4f}")


class _BenchProgress:
    """Requests done per concurrency level, as a rich bar on a terminal (stderr)."""

    def __init__(self, quiet: bool) -> None:
        self.bar: Any = None
        self.quiet = quiet
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> _BenchProgress:
        if not self.quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                console=Console(stderr=True), transient=True)  # fmt: skip
            self.bar.start()
        return self

    def update(self, label: str, done: int, total: int) -> None:
        if self.bar is None:
            return
        if label not in self.tasks:
            self.tasks[label] = self.bar.add_task(label, total=total)
        self.bar.update(self.tasks[label], completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


class _EvalProgress:
    """A rich progress bar of evaluated tokens on a terminal (stderr); nothing otherwise."""

    def __init__(self, quiet: bool) -> None:
        self.bar: Any = None
        self.quiet = quiet

    def __enter__(self) -> _EvalProgress:
        if not self.quiet and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("evaluating"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=True)  # fmt: skip
            self.bar.start()
            self.task = self.bar.add_task("eval", total=None)
        return self

    def update(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def compile_mode(flag: bool | None) -> str:
    """`--compile` / `--no-compile` / neither → the torch engine's compile mode."""
    return "auto" if flag is None else "on" if flag else "off"


def _json_schema_format(path: Path) -> dict[str, Any]:
    """`--json-schema FILE` as an OpenAI response_format (one line for a missing or bad file)."""
    try:
        schema = json.loads(path.expanduser().read_text())
    except OSError as e:
        raise LocalLLMError(f"--json-schema {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise LocalLLMError(f"--json-schema {path}: not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise LocalLLMError(f"--json-schema {path}: a JSON schema is an object")
    return {"type": "json_schema", "json_schema": {"name": path.stem or "schema", "schema": schema}}


@app.command()
def quantize(
    src: Annotated[str, typer.Argument(help="A local model name or a GGUF file (F32/F16/BF16).")],
    type_name: Annotated[
        str, typer.Option("--type", help="Q4_K_M, Q4_K_S, Q5_K_M, Q5_K_S, Q6_K, Q8_0, IQ4_XS, IQ4_NL, Q3_K_L, Q3_K_M, Q3_K_S, "
                     "Q2_K, Q5_1, Q5_0, Q4_1, Q4_0, BF16, F16, F32; IQ3_M, IQ3_S, IQ3_XS, IQ3_XXS, IQ2_M, IQ2_S, "
                     "IQ2_XS, IQ2_XXS, Q2_K_S, IQ1_M, IQ1_S (all but IQ3_M/IQ3_S need --calibrate).")
    ],
    output: Annotated[
        Path | None, typer.Option("--output", help="Write the GGUF here instead of the store.")
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="Register it under this name (default SRC:TYPE).")
    ] = None,
    engine: Annotated[
        str, typer.Option("--engine", help="auto (ours when it has every type), localllm, llama.cpp.")
    ] = "auto",
    allow_requantize: Annotated[
        bool, typer.Option("--allow-requantize", help="Quantize an already quantized model (warns).")
    ] = False,
    eval_text: Annotated[
        Path | None,
        typer.Option("--eval", help="A text to measure the result on against the source: "
                     "perplexity, KL divergence, top-1 agreement (kept for `show`)."),  # fmt: skip
    ] = None,
    eval_limit: Annotated[
        int, typer.Option("--eval-limit", help="Tokens of the --eval text to use.")
    ] = 1024,
    calibrate: Annotated[
        Path | None,
        typer.Option("--calibrate", help="A text the torch engine runs the model over: each "
                     "matrix's input activations weight its quantization (an importance matrix); "
                     "or an importance matrix file llama-imatrix made (GGUF or .dat)."),  # fmt: skip
    ] = None,
    calibrate_tokens: Annotated[
        int, typer.Option("--calibrate-tokens", help="Tokens of the --calibrate text to use.")
    ] = 4096,
    save_imatrix: Annotated[
        Path | None,
        typer.Option("--save-imatrix", help="Keep the importance matrix --calibrate TEXT collects, "
                     "in llama.cpp's format (GGUF; .dat: the legacy one) for llama-quantize "
                     "--imatrix or a later --calibrate."),  # fmt: skip
    ] = None,
    method: Annotated[
        str,
        typer.Option("--method", help="plain (llama.cpp's rounding); gptq (error-correcting: "
                     "each matrix's rounding error fed forward through its Hessian from the "
                     "--calibrate text), awq (activation-aware scales folded into the norms) or "
                     "awq+gptq (both) — same blocks, same size, any llama.cpp reads them."),  # fmt: skip
    ] = "plain",
    json_out: JsonFlag = False,
) -> None:
    """Quantize a model with llama.cpp's per-tensor type rules; byte-identical to llama.cpp."""
    from localllm.model_info import human_bytes
    from localllm.quant.job import run_quantize

    show = _QuantizeProgress(quiet=json_out)
    try:
        with show:
            job = run_quantize(_store(), src, type_name, output=output, name=name, engine=engine,
                               allow_requantize=allow_requantize, eval_text=eval_text,
                               eval_limit=eval_limit, calibrate=calibrate,
                               calibrate_tokens=calibrate_tokens, save_imatrix=save_imatrix,
                               method=method, on_tensor=show.update)  # fmt: skip
    except KeyboardInterrupt:
        print("quantize interrupted: nothing was written", file=sys.stderr)
        raise typer.Exit(130) from None
    result, where, report, kind = job.result, job.where, job.report, job.result.file_type
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    counts: dict[str, int] = {}
    for t in result.types.values():
        counts[t] = counts.get(t, 0) + 1
    if json_out:
        _emit_json({"model": where, "type": kind, "engine": result.engine, "bytes": result.nbytes,
                    "bits_per_weight": round(result.bits_per_weight, 3), "tensor_types": counts,
                    "seconds": round(result.seconds, 2), "warnings": result.warnings,
                    "quality": report})  # fmt: skip
        return
    mix = ", ".join(f"{n} {t}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    print(f"quantized {job.source} → {where}: {kind}, {human_bytes(result.nbytes)}, "
          f"{result.bits_per_weight:.2f} bits/weight ({mix}) by {result.engine} "
          f"in {result.seconds:.1f} s")  # fmt: skip
    if report is not None:
        from localllm.quant.report import report_table

        print("Quality:")
        for label, value in report_table(report):
            print(f"  {label:<15} {value}")


@app.command()
def convert(
    folder: Annotated[Path, typer.Argument(help="A Hugging Face checkpoint folder (safetensors).")],
    output: Annotated[Path, typer.Option("--output", help="The GGUF file to write.")],
    outtype: Annotated[str, typer.Option("--outtype", help="f32, f16, bf16 or q8_0.")] = "f16",
) -> None:
    """Convert a Llama / Mistral / Qwen2 safetensors checkpoint to GGUF."""
    from localllm.model_info import human_bytes
    from localllm.quant.convert import convert as do_convert

    try:
        path = do_convert(folder, output, outtype.lower())
    except KeyboardInterrupt:
        print("convert interrupted: nothing was written", file=sys.stderr)
        raise typer.Exit(130) from None
    print(f"converted {folder} → {path} ({outtype.lower()}, {human_bytes(path.stat().st_size)}); "
          f"`localllm import {path}` registers it")  # fmt: skip


class _QuantizeProgress(_StderrBar):
    """Per-tensor progress: a rich bar on a terminal, nothing otherwise (the summary follows)."""

    transient = True

    def columns(self) -> tuple[Any, ...]:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn

        return TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()

    def update(self, e: Any) -> None:
        if self.bar is None:
            return
        if self.task is None:
            self.task = self.bar.add_task("quantizing", total=e.total)
        self.bar.update(self.task, completed=e.index, description=f"{e.name} → {e.type_name}")


def _server_missing() -> LocalLLMError | None:
    from importlib.util import find_spec

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if find_spec(m) is None]
    if missing:
        return LocalLLMError(f"the server needs {', '.join(missing)}: pip install 'localllm[server]'")
    return None


@app.command()
def serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port (0: any free one).")] = 11435,
    model: Annotated[
        list[str] | None, typer.Option("--model", help="Model to load and serve (repeatable; the first is the default).")
    ] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", help="Require this key (Bearer or x-api-key).")] = None,
    api_key_file: Annotated[
        Path | None, typer.Option("--api-key-file", help="Read the key from this file's first line.")
    ] = None,
    backend: Annotated[str, typer.Option("--backend", help=BACKEND_HELP)] = "auto",
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="torch engine's working precision.")] = "auto",
    ctx: Annotated[int | None, typer.Option("--ctx", help="Context length per sequence.")] = None,
    kv_cache: Annotated[str, typer.Option("--kv-cache", help="KV cache type (as for run).")] = "f16",
    speculative: Annotated[
        str | None, typer.Option("--speculative", help="off, lookup, self or draft:MODEL (the default per request).")
    ] = None,
    parallel: Annotated[int, typer.Option("--parallel", help="Sequences decoded together per model.")] = 4,
    compile_step: CompileFlag = None,
    gpu_layers: GpuLayersOption = "auto",
    tensor_split: TensorSplitOption = None,
    cpu_moe: CpuMoeOption = None,
    queue: Annotated[int, typer.Option("--queue", help="Requests that may wait for a slot before 503.")] = 16,
    cors: Annotated[
        list[str] | None, typer.Option("--cors", help="Origin allowed to call from a browser (repeatable).")
    ] = None,
    max_body: Annotated[int, typer.Option("--max-body", help="Largest request body in bytes.")] = 8 * 1024 * 1024,
    keep_alive: Annotated[
        str, typer.Option("--keep-alive", help="How long a model no request holds stays loaded: "
                          "5m, 1h, 30s, 0 (unload at once), -1 (until `localllm stop`).")  # fmt: skip
    ] = "5m",
) -> None:
    """Serve the OpenAI and Ollama APIs on this machine (127.0.0.1:11435 by default)."""
    from localllm.server.config import ServerConfig, keep_alive_seconds, read_api_key
    from localllm.types import LoadOptions

    missing = _server_missing()
    if missing:
        raise missing
    options = LoadOptions(backend=backend, device=device, dtype=dtype, ctx=ctx, kv_cache=kv_cache,
                          speculative=speculative, parallel=parallel,
                          compile=compile_mode(compile_step), gpu_layers=gpu_layers,
                          tensor_split=tensor_split, cpu_moe=cpu_moe)  # fmt: skip
    config = ServerConfig(host=host, port=port, models=tuple(model or ()), cors=tuple(cors or ()),
                          api_key=read_api_key(api_key, api_key_file), options=options,
                          queue=queue, max_body=max_body,
                          keep_alive=keep_alive_seconds(keep_alive, "--keep-alive"))  # fmt: skip
    from localllm.server.runner import serve_forever

    serve_forever(config, announce=lambda line: print(line, file=sys.stderr, flush=True))


@app.command()
def ps(
    url: Annotated[str | None, typer.Option("--url", help="The server (default: the running one, "
                                            "else http://127.0.0.1:11435).")] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", help="Its API key (else $LOCALLLM_API_KEY).")] = None,
    json_out: JsonFlag = False,
) -> None:
    """What a running server has loaded."""
    from localllm.model_info import human_bytes

    url, reply = _ask_server(url, api_key, "/api/ps")
    models = reply.get("models", [])
    if json_out:
        _emit_json({"url": url, "models": models})
        return
    if not models:
        print(f"{url}: no model loaded")
        return
    print(f"{'NAME':34} {'BACKEND':9} {'CTX':>6} {'KV':>6} {'RUN':>4} {'WAIT':>4} {'SIZE':>9}  UNTIL")
    for m in models:
        x = m.get("localllm", {})
        print(f"{m['name']:34} {x.get('backend', '?'):9} {x.get('ctx', 0):>6} {x.get('kv_cache', ''):>6} "
              f"{x.get('running', 0):>4} {x.get('waiting', 0):>4} {human_bytes(m.get('size', 0)):>9}  "
              f"{m.get('expires_at', '')[:19]}")


@app.command()
def stop(
    model: Annotated[str, typer.Argument(help="The model to unload, e.g. smollm2.")],
    url: Annotated[str | None, typer.Option("--url", help="The server (default: the running one, "
                                            "else http://127.0.0.1:11435).")] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", help="Its API key (else $LOCALLLM_API_KEY).")] = None,
) -> None:
    """Unload a model from the running server (as soon as its requests end)."""
    url, reply = _ask_server(url, api_key, "/api/generate", {"model": model, "keep_alive": 0})
    print(f"{reply.get('model', model)}: unloaded from {url}")


def _ask_server(url: str | None, api_key: str | None, path: str,
                body: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """(the server's URL, its JSON reply) for GET `path` (POST with `body`); errors are one line."""
    import urllib.error
    import urllib.request

    key = api_key or os.environ.get("LOCALLLM_API_KEY")
    if url is None:
        from localllm.server.runner import running

        up = running()
        url = up.url if up else "http://127.0.0.1:11435"
        key = key or (up.key if up else None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data, headers = json.dumps(body).encode(), headers | {"Content-Type": "application/json"}
    try:
        request = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as r:
            return url, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            said = json.loads(e.read())["error"]
            message = said if isinstance(said, str) else said["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {e.code}"
        raise LocalLLMError(f"{url}: {message}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise LocalLLMError(f"no localllm server answers at {url} ({type(e).__name__})") from None


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the command; errors become one line and an exit code."""
    command = typer.main.get_command(app)
    args = sys.argv[1:] if argv is None else argv
    try:
        rc = command.main(args, prog_name="localllm", standalone_mode=False)
        if rc == 130:  # typer turns Ctrl-C into a silent return of 130
            print("interrupted", file=sys.stderr)
    except LocalLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        rc = 1
    except typer.Exit as e:
        rc = e.exit_code
    except click_exc.UsageError as e:
        e.show()
        rc = 2
    except click_exc.ClickException as e:
        e.show()
        rc = e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        print("interrupted", file=sys.stderr)
        rc = 130
    except BrokenPipeError:
        # stdout closed early (`localllm list | head`): not an error worth a traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        rc = 0
    sys.exit(rc if isinstance(rc, int) else 0)
