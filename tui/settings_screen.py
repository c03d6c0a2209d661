"""Per-conversation settings: system prompt, sampling, and the engine options the backend declares.

The backend is chosen here (every name `--backend` takes), and the engine options offered are what
that backend's `Capabilities` say it can do — read from the registry (`localllm.backends`), which
imports no backend module, so the screen works before anything is loaded. Changing the backend
redraws the options for it. Nothing is offered that the backend would refuse, and values are
checked the way `load()` checks them (`LoadOptions`, `check_options`) before they are saved.
"""

from __future__ import annotations

from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from localllm import backends
from localllm.errors import LocalLLMError
from localllm.memory import DEFAULT_CTX
from localllm.types import LoadOptions

# (key, label, parser): blank means "the model's / engine's default"
SAMPLING = (
    ("temperature", "Temperature (0 = greedy)", float),
    ("top_p", "Top-p", float),
    ("top_k", "Top-k", int),
    ("min_p", "Min-p", float),
    ("max_tokens", "Max tokens per answer", int),
    ("seed", "Seed", int),
)

Result = tuple[str | None, dict[str, Any], LoadOptions]
SAME = "same"  # the value cache's choice that follows the key cache's


def _kv_pair(spec: str) -> tuple[str, str]:
    """`q8_0` → (q8_0, q8_0); `k=q8_0,v=q4_0` → (q8_0, q4_0); anything unreadable: f16."""
    from localllm.memory import parse_kv_cache

    try:
        return parse_kv_cache(spec)
    except LocalLLMError:
        return "f16", "f16"


def _kv_spec(k: str, v: str) -> str:
    return k if v in (SAME, k) else f"k={k},v={v}"


def capabilities_of(name: str) -> tuple[Any, str]:
    """(Capabilities or None, one line saying what the backend can do or why it is not here)."""
    try:
        spec = backends.describe(name)
    except LocalLLMError as e:
        return None, str(e)
    c = spec.capabilities
    parts = [f"KV {' '.join(c.kv_cache_types)}",
             "context shift" if c.streaming else "no context shift",
             f"speculative: {', '.join(c.speculative)}",
             f"eviction: {', '.join(c.eviction)}" if c.eviction else "no eviction",
             "constrained decoding" if c.grammar else "no constrained decoding",
             "batching" if c.batching else "one sequence at a time"]  # fmt: skip
    auto = " (auto)" if name == "auto" else ""
    return c, f"{spec.name}{auto}: " + "; ".join(parts)


class SettingsScreen(ModalScreen[Result | None]):
    """Returns (system prompt, sampling keywords, LoadOptions), or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, system: str | None, sampling: dict[str, Any],
                 options: LoadOptions | None = None) -> None:  # fmt: skip
        super().__init__()
        self.options = options or LoadOptions()
        o = self.options
        spec_mode, _, draft = (o.speculative or "off").partition(":")
        # the form's values, kept across redraws (a backend change redraws the engine part)
        self.form: dict[str, Any] = {
            "system": system or "",
            **{k: "" if sampling.get(k) is None else str(sampling[k]) for k, _l, _p in SAMPLING},
            "backend": o.backend, "ctx": str(o.ctx or ""), "kv_cache": o.kv_cache,
            "streaming": o.streaming or "", "evict": o.evict or "", "speculative": spec_mode,
            "draft": draft, "device": o.device, "dtype": o.dtype, "gpu_layers": o.gpu_layers,
            "tensor_split": o.tensor_split or "", "cpu_moe": "" if o.cpu_moe is None else str(o.cpu_moe),
        }  # fmt: skip
        self.caps, self.caps_text = capabilities_of(o.backend)

    def compose(self) -> ComposeResult:
        f = self.form
        with VerticalScroll(id="dialog"):
            yield Label("System prompt")
            yield Input(f["system"], id="system", placeholder="(none)")
            for key, label, _ in SAMPLING:
                yield Label(label)
                yield Input(f[key], id=key, placeholder="the model's default")
            yield Label("Backend (engine options below reload the model)")
            names = backends.names()
            choice = f["backend"] if f["backend"] in names else "auto"
            yield Select([(n, n) for n in names], value=choice, id="backend", allow_blank=False)
            yield Static(self.caps_text, id="caps")
            yield Label("Context size (tokens)")
            yield Input(f["ctx"], id="ctx", placeholder=f"default {DEFAULT_CTX}")
            caps = self.caps
            if caps is not None:
                types = caps.kv_cache_types
                k_type, v_type = _kv_pair(str(f["kv_cache"]))
                if "kv_v" in f:  # read back from the widgets before a redraw
                    v_type = k_type if f["kv_v"] == SAME else str(f["kv_v"])
                fallback = "f16" if "f16" in types else types[0]
                yield Label("KV cache type (keys, and values unless set below)")
                yield Select([(t, t) for t in types], id="kv_cache", allow_blank=False,
                             value=k_type if k_type in types else fallback)  # fmt: skip
                yield Label("Value cache type (keys are the sensitive half: e.g. keys q8_0 / "
                            "int8, values q4_0 / int4)")  # fmt: skip
                yield Select([("same as keys", SAME), *((t, t) for t in types)], id="kv_v",
                             allow_blank=False,
                             value=v_type if v_type in types and v_type != k_type else SAME)  # fmt: skip
                if caps.streaming:
                    yield Label("Context shift SINKS:WINDOW (blank: refuse on overflow)")
                    yield Input(f["streaming"], id="streaming", placeholder="e.g. 4:2044")
                if len(caps.speculative) > 1:
                    yield Label("Speculative decoding")
                    mode = f["speculative"] if f["speculative"] in caps.speculative else "off"
                    yield Select([(m, m) for m in caps.speculative], value=mode, id="speculative",
                                 allow_blank=False)  # fmt: skip
                    if "draft" in caps.speculative:
                        yield Label("Draft model (for draft mode)")
                        yield Input(f["draft"], id="draft", placeholder="e.g. smollm2")
                if caps.eviction:
                    yield Label(f"KV eviction ({', '.join(caps.eviction)}; blank: none)")
                    yield Input(f["evict"], id="evict", placeholder="e.g. h2o:1024")
                if len(caps.devices) > 1:
                    yield Label("Device")
                    devices = ("auto", *caps.devices)
                    yield Select([(d, d) for d in devices], id="device", allow_blank=False,
                                 value=f["device"] if f["device"] in devices else "auto")  # fmt: skip
                if len(caps.dtypes) > 1:
                    yield Label("Working precision (auto: bf16 on a GPU, f16 weights on a CPU)")
                    dtypes = ("auto", *caps.dtypes)
                    yield Select([(d, d) for d in dtypes], id="dtype", allow_blank=False,
                                 value=f["dtype"] if f["dtype"] in dtypes else "auto")  # fmt: skip
                if caps.placement:
                    yield Label("Layers on the GPU: auto (the planner's, as `localllm show` "
                                "prints it), all, or a number (0: CPU only)")  # fmt: skip
                    yield Input(str(f["gpu_layers"]), id="gpu_layers", placeholder="auto")
                    yield Label("Split between GPUs, e.g. 3,1 (blank: by free memory)")
                    yield Input(str(f["tensor_split"]), id="tensor_split", placeholder="by free memory")
                    yield Label("MoE models: layers whose experts stay in RAM (blank: the planner's)")
                    yield Input(str(f["cpu_moe"]), id="cpu_moe", placeholder="the planner's")
            with Horizontal():
                yield Button("Save (ctrl+s)", id="save", variant="primary")
                yield Button("Cancel (esc)", id="cancel")

    @on(Select.Changed, "#backend")
    async def _backend_changed(self, event: Select.Changed) -> None:
        if event.value == self.form["backend"]:
            return
        self.form = self._read_form()
        self.form["backend"] = event.value
        self.caps, self.caps_text = capabilities_of(str(event.value))
        await self.recompose()
        self.query_one("#backend", Select).focus()

    def _read_form(self) -> dict[str, Any]:
        """What the widgets hold now (widgets a backend does not offer keep their last value)."""
        form = dict(self.form)
        for w in self.query(Input):
            form[w.id] = w.value
        for w in self.query(Select):
            form[w.id] = w.value
        return form

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_save(self) -> None:
        try:
            result = self.values()
        except (LocalLLMError, ValueError) as e:
            self.app.fail(str(e))
            return
        self.dismiss(result)

    def values(self) -> Result:
        """The form's values, checked the way the engine will check them."""
        from localllm.backends import check_options
        from localllm.types import SamplingParams

        f = self._read_form()
        sampling: dict[str, Any] = {}
        for key, label, parse in SAMPLING:
            raw = str(f[key]).strip()
            if raw:
                try:
                    sampling[key] = parse(raw)
                except ValueError:
                    raise LocalLLMError(f"{label}: {raw!r} is not a number") from None
        SamplingParams.from_kwargs(**sampling)  # raises the engine's own one-line message
        ctx = str(f["ctx"]).strip()
        if ctx and not ctx.isdigit():
            raise LocalLLMError(f"context size {ctx!r}: a whole number of tokens")
        if self.caps is None:  # a backend this build cannot describe: say why, save nothing
            raise LocalLLMError(self.caps_text)
        offered = {w.id for w in self.query(Input)} | {w.id for w in self.query(Select)}

        def text(key: str) -> str | None:  # what an offered field says; None when blank or absent
            return (str(f[key]).strip() or None) if key in offered else None

        mode = str(f["speculative"]) if "speculative" in offered else "off"
        if mode == "draft" and not text("draft"):
            raise LocalLLMError("draft mode needs a draft model")
        moe = text("cpu_moe")
        if moe is not None and not moe.isdigit():
            raise LocalLLMError(f"MoE experts in RAM {moe!r}: a whole number of layers")
        engine = {
            "backend": f["backend"],
            "gpu_layers": text("gpu_layers") or "auto",
            "tensor_split": text("tensor_split"),
            "cpu_moe": int(moe) if moe is not None else None,
            "ctx": int(ctx) if ctx else None,
            "kv_cache": (_kv_spec(str(f["kv_cache"]), str(f.get("kv_v", SAME)))
                         if "kv_cache" in offered else self.options.kv_cache),
            "streaming": text("streaming"),
            "evict": text("evict"),
            "device": f["device"] if "device" in offered else "auto",
            "dtype": f["dtype"] if "dtype" in offered else "auto",
            "speculative": f"draft:{text('draft')}" if mode == "draft" else None if mode == "off"
            else mode,
        }  # fmt: skip
        options = self.options.replace(**engine)  # keeps what this screen does not show
        spec = backends.describe(options.backend, options)
        check_options(options, spec.capabilities, spec.name)
        system = str(f["system"]).strip() or None
        return system, sampling, options
