"""Each stage's options, declared once: every option with its type, default and help, and the
rules that tie options together. From these dataclasses come the CLI's flags (`add_arguments`),
a Job's arguments (`to_args`), the operator's reading of a ProxyModel section (`from_crd`) and
that section's CRD schema (`crd_properties`, checked against crds/ by a test). An option the
ProxyModel does not have says why in `cli_only`. Torch-free.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable

from moe_proxy.errors import CannotMerge, InvalidOptions

# The pruning options' vocabulary.
SCORED_METHODS = ("frequency", "saliency")  # selection by routing mass / REAP saliency: need statistics
CALIBRATED_FEATURES = ("routing", "output")  # features measured on calibration tokens
METHODS = ("cluster", "random", "first-n", *SCORED_METHODS)
FEATURES = ("router", "weights", *CALIBRATED_FEATURES)
CLUSTERINGS = ("kmeans", "agglomerative")
REPRESENTATIVES = ("medoid", "saliency")
GROUPED_METHODS = ("cluster", *SCORED_METHODS)  # methods that group the other experts under each kept one
# The selection a build makes without flags. `calibrate --experts N` makes its sequential
# statistics for this very selection, so the two match without further flags.
DEFAULT_METHOD, DEFAULT_FEATURES = "cluster", "router"
# Super experts kept because they can make a failure (issue 30; calibrate/statistics.py): a live
# expert whose max |output| reaches this share of fp16's range, or this many times its layer's median.
FP16_MAX = 65504.0
SUPER_RANGE_SHARE = 1 / 8
SUPER_OUTLIER = 100.0  # the lab's trained qwen3 has ordinary layers whose largest is 15-40x the median
PIN = re.compile(r"^[0-9]+:[0-9]+$")
S3_URI = r"^s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?$"  # what a ProxyModel's locations must be


@dataclass(frozen=True)
class Opt:
    """How one option is spelled and checked everywhere. `kind`: int, float, str, bool (a flag;
    default True gives --no-NAME), tristate (--NAME/--no-NAME, None = the rule's default),
    count (a whole number or "auto"), pins (LAYER:EXPERT items)."""

    kind: str
    help: str
    crd: str | None = None  # the ProxyModel field; None: CLI-only, `cli_only` says why
    cli_only: str = ""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    minimum: float | None = None
    above: float | None = None  # exclusive minimum
    maximum: float | None = None
    crd_schema: dict = field(default_factory=dict)  # what the CRD checks beyond the CLI (e.g. s3:// only)
    crd_default: Any = None  # where a ProxyModel's default differs from the CLI's (e.g. bf16 on accelerators)


def option(default: Any, kind: str, help: str, **opt) -> Any:
    factory = {"default_factory": dict} if default is dict else {"default": default}
    return field(**factory, metadata={"option": Opt(kind, help, **opt)})


def options_of(cls) -> list[tuple[str, Opt, Any]]:
    """(name, Opt, default) of each declared option of an options dataclass."""
    out = []
    for f in fields(cls):
        if "option" in f.metadata:
            default = f.default if f.default is not MISSING else f.default_factory()
            out.append((f.name, f.metadata["option"], default))
    return out


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ----------------------------------------------------------------------------- the build

@dataclass
class PruningOptions:
    """What `moe-proxy build` is asked to make (and what its build id is computed from)."""

    experts: int | str | None = option(None, "count", "routed experts to keep per MoE layer; auto (with --max-kl "
                                       "and --calibration): the smallest count whose fidelity figure meets the target",
                                       crd="experts", metavar="N|auto", minimum=1)
    keep_ratio: float | None = option(None, "float", "fraction of routed experts to keep, in (0, 1]: rounded to the same "
                                      "number per routing group, raised to 2 x top-k when the device budget holds it "
                                      "(the count `moe-proxy plan` shows; the build's notes say so)",
                                      crd="keepRatio", metavar="R", above=0, maximum=1)
    method: str = option(DEFAULT_METHOD, "str", "cluster: one representative per cluster; frequency / saliency: "
                         "top-N by gate mass / REAP saliency (need calibration); random and first-n are baselines",
                         crd="method", choices=METHODS)
    features: str = option(DEFAULT_FEATURES, "str", "what to cluster on: router rows (cheap), a projection of expert "
                           "weights, or with calibration: routing (router logits on probe tokens) / output "
                           "(expert outputs)", crd="features", choices=FEATURES)
    clustering: str = option("kmeans", "str", "how experts are clustered (scikit-learn)", crd="clustering",
                             choices=CLUSTERINGS)
    seed: int = option(0, "int", "seed of clustering and of --method random (the same seed, the same proxy)",
                       crd="seed", minimum=0)
    top_k: int | None = option(None, "int", "experts per token in the proxy (default: the source's, clamped to what "
                               "is kept)", crd="topK", metavar="K", minimum=1)
    pins: dict[int, list[int]] = option(dict, "pins", "always keep these experts, as LAYER:EXPERT (e.g. ones "
                                        "implicated in a failure)", crd="pin", metavar="LAYER:EXPERT[,...]")
    # Usage-aware selection, from `moe-proxy calibrate` statistics at this location.
    calibration: str | None = option(None, "str", "statistics of this checkpoint (moe-proxy calibrate; best: "
                                     "calibrate --experts N for this very proxy): dead experts are never kept, super "
                                     "experts always are, and the kept experts are reconstructed",
                                     metavar="STATS", cli_only="a ProxyModel's spec.calibration makes the statistics "
                                     "and the operator passes their location")
    keep_super: bool = option(True, "bool", "force super experts (massive output activations) into the proxy, with "
                              "calibration", crd="keepSuper")
    fill_dead: bool = option(False, "bool", "with calibration: where a layer has fewer alive experts than the count "
                             "(a collapsed router), keep its most-routed dead experts to fill it, named in the "
                             "manifest (dead_kept) and the notes, instead of refusing; bisect's and triage's probes "
                             "and the operator's bisection probes always do", crd="fillDead")
    super_range_share: float = option(SUPER_RANGE_SHARE, "float", "with calibration: in every MoE layer, an expert "
                                      f"whose max |output| on the calibration tokens reaches this share of fp16's "
                                      f"range ({FP16_MAX:g}) is super: it can overflow in half precision (above 1: "
                                      f"rule off)", crd="superRangeShare", metavar="S", above=0)
    super_outlier: float = option(SUPER_OUTLIER, "float", "with calibration: in every MoE layer, an expert whose max "
                                  "|output| is this many times its layer's median (over live experts) is super",
                                  crd="superOutlier", metavar="X", above=1)
    representative: str | None = option(None, "str", "each cluster's kept expert: saliency (default with "
                                        "calibration) or medoid", crd="representative", choices=REPRESENTATIVES)
    heal: bool = option(False, "bool", "re-fit the kept router rows so each proxy MoE block matches the original's "
                        "output (needs calibration; not with reconstruct)", crd="heal")
    reconstruct: bool | None = option(None, "tristate", "re-fit the kept experts and router rows layer by layer "
                                      "(inputs through the proxy, a held-out split stops it; a layer keeps its plain "
                                      "tensors unless fitting helps). Default: on with calibration, unless heal",
                                      crd="reconstruct")
    max_kl: float | None = option(None, "float", "with experts auto: the largest KL(original || proxy) per token "
                                  "accepted, in nats, on held-out calibration tokens", crd="maxKL", metavar="X",
                                  above=0)
    merge: bool = option(False, "bool", "each kept expert becomes the gate-mass-weighted average of its cluster's "
                         "members, their hidden units aligned first (needs calibration; with reconstruction: merged, "
                         "then fitted)", crd="merge")

    @property
    def auto(self) -> bool:
        return self.experts == "auto"

    @property
    def fits(self) -> bool:
        """Whether the build fits tensors on top of selecting experts (a scale-out fits them once)."""
        return bool(self.heal or self.reconstruct or self.merge)

    def resolved(self) -> "PruningOptions":
        """These options with the defaults that depend on others applied (reconstruct), checked."""
        self.validate()
        if self.reconstruct is None:
            self.reconstruct = reconstructs(bool(self.calibration), self.heal)
        return self

    def validate(self) -> None:
        """The rules that tie the pruning options together, checked before anything is read."""
        if self.merge:
            if not self.calibration:
                raise CannotMerge("--merge needs --calibration STATS (from moe-proxy calibrate): members are "
                                  "weighted by the gate mass they receive on the calibration tokens")
            if self.method not in GROUPED_METHODS:
                raise CannotMerge(f"--merge with --method {self.method}: a baseline that picks experts without "
                                  f"grouping the others under them, so there is nothing meaningful to merge; use "
                                  f"--method {', '.join(GROUPED_METHODS)}")
            if self.heal:
                raise CannotMerge("--merge and --heal: --heal fits the router to the unmerged experts; use --merge "
                                  "--reconstruct, which re-fits the router rows with the merged experts")
        needs = [f"--{what}" for what in calibration_needs(self) if what != "experts auto"]
        if needs and not self.calibration:
            raise InvalidOptions(f"{', '.join(needs)} need(s) --calibration STATS (from moe-proxy calibrate)")
        if self.heal and self.reconstruct:
            raise InvalidOptions("--heal and --reconstruct: --reconstruct already re-fits the router rows (with "
                                 "the kept experts); pass one of them")


# The build's options `moe-proxy calibrate --experts N` takes besides the count, to make sequential
# statistics for the very proxy a build with them makes (calibrate.criteria.selection_key; not seed:
# calibrate's --seed is the tokens'; fill_dead is not in the key either: it changes no selection
# that would be made without it, it only makes one where that refuses).
SELECTION = ("top_k", "method", "features", "clustering", "representative", "keep_super", "super_range_share",
             "super_outlier", "fill_dead")


def statistics_flags(options: PruningOptions, sequential: bool = True) -> list[str]:
    """The `moe-proxy calibrate` flags of the statistics a build with `options` needs (bisect's
    probes and the operator's calibrate step both ask here): sequential statistics made for its
    very proxy (its count and selection) when it has a count, else one pass over the original,
    usable for any count (experts auto, a ratio)."""
    if sequential and isinstance(options.experts, int):
        return ["--sequential", *to_args(options, only=("experts", *SELECTION),
                                         always=("experts", "method", "features"))]
    return ["--one-pass"]


def reconstructs(calibrated: bool, heal: bool, reconstruct: bool | None = None) -> bool:
    """Whether a build re-fits its kept experts and router rows: as asked, else whenever it has
    calibration statistics (docs/fidelity.md), unless heal re-fits the router rows instead
    (the two exclude each other)."""
    return reconstruct if reconstruct is not None else calibrated and not heal


def calibration_needs(o: PruningOptions) -> list[str]:
    """The options in this combination that need calibration statistics, as `name value` words."""
    return [what for what, used in (
        (f"method {o.method}", o.method in SCORED_METHODS),
        (f"features {o.features}", o.features in CALIBRATED_FEATURES),
        ("representative saliency", o.representative == "saliency"),
        ("heal", o.heal), ("reconstruct", bool(o.reconstruct)),
        ("merge", o.merge),  # members weighted by gate mass
        ("experts auto", o.auto)) if used]  # the fidelity figure is measured on the calibration tokens


# ----------------------------------------------------------------------------- calibration tokens

@dataclass
class TokenOptions:
    """The calibration tokens `moe-proxy calibrate` runs (a ProxyModel's spec.calibration)."""

    dataset: str | None = option(None, "str", "local file or s3://bucket/key: JSONL (text, prompt, or verl chat "
                                 "prompt), parquet (needs pyarrow) or plain text; default: seeded random token ids",
                                 crd="dataset", metavar="FILE", crd_schema={"pattern": S3_URI, "maxLength": 1024})
    samples: int = option(64, "int", "calibration sequences", crd="samples", metavar="N", minimum=1)
    seq_len: int = option(256, "int", "tokens per sequence", crd="seqLen", metavar="L", minimum=1)
    seed: int = option(0, "int", "seed of the sampled sequences (and of the random token ids)", crd="seed",
                       minimum=0)
    batch_size: int = option(8, "int", "sequences per forward", metavar="B", minimum=1,
                             cli_only="memory of the machine that runs it, not a property of the statistics")


# ----------------------------------------------------------------------------- shared flags

@dataclass
class OutputOptions:
    """How a command reports: flags several commands share, declared here once (a command
    takes the ones it has with `add_arguments(..., only=...)`)."""

    json: bool = option(False, "bool", "print the result as JSON", cli_only="terminal output")
    no_progress: bool = option(False, "bool", "no progress bars",
                               cli_only="terminal output (the operator's Jobs pass it)")
    termination_log: str | None = option(None, "str", "also write the result as JSON here (Kubernetes' "
                                         "/dev/termination-log)", metavar="PATH",
                                         cli_only="the operator reads its Jobs' results from /dev/termination-log")


_STORE = "the operator sets the transfer from spec.source and its defaults"


@dataclass
class StoreOptions:
    """How s3:// locations are reached (storage.open_store's keyword arguments). Concurrency is
    sized to the store and memory bounded: storage/inflight.py has the rule."""

    endpoint_url: str | None = option(None, "str", "S3-compatible endpoint (MinIO, Ceph RGW, OBS); default "
                                      "$AWS_ENDPOINT_URL", metavar="URL", cli_only="spec.source.endpoint")
    region: str | None = option(None, "str", "region; default from the standard AWS configuration chain",
                                cli_only="spec.source.region")
    streams: int | None = option(None, "int", "requests in flight each way (reads, uploads); default: the in-flight "
                                 "budget / 2 / read part. To fill a link of R MB/s at r MB/s per connection and "
                                 "latency L s: R/r + R*L/part", metavar="N", cli_only=_STORE)
    max_inflight_mb: float | None = option(None, "float", "bytes held by reads and uploads in flight, together; "
                                           "default: half of one MoE layer's routed experts (64 MiB to 1 GiB), which "
                                           "keeps memory under 1.5 x one layer + 512 MiB", metavar="MB",
                                           cli_only=_STORE)
    read_part_mb: float | None = option(None, "float", "bytes per ranged read, at most (default 8; smaller when "
                                        "--streams would not fit the budget)", metavar="MB", cli_only=_STORE)

    def given(self) -> dict:
        """The options set, as open_store's keyword arguments."""
        return {name: value for name, _, _ in options_of(type(self)) if (value := getattr(self, name))}


# ----------------------------------------------------------------------------- generators

def spelled(name: str, opt: Opt, default: Any) -> list[str]:
    """The flags that set option `name`: --NAME, --no-NAME for a bool that defaults on, both for a
    tristate, --pin for pins."""
    if opt.kind == "bool":
        return [flag(f"no_{name}")] if default else [flag(name)]
    if opt.kind == "tristate":
        return [flag(name), flag(f"no_{name}")]
    return [flag(name.rstrip("s") if opt.kind == "pins" else name)]


def _selected(cls, only: tuple[str, ...] | None, skip: tuple[str, ...] | set[str]):
    return [(name, opt, default) for name, opt, default in options_of(cls)
            if (only is None or name in only) and name not in skip]


def add_arguments(parser, cls, only: tuple[str, ...] | None = None, skip: tuple[str, ...] = (),
                  helps: dict[str, str] | None = None, defaults: dict[str, Any] | None = None,
                  required: tuple[str, ...] = ()) -> None:
    """argparse flags for the options of `cls` (`only` / `skip` by name; `helps`, `defaults`
    and `required` adjust one command's use of an option without declaring it again)."""
    for name, opt, default in _selected(cls, only, skip):
        default = (defaults or {}).get(name, default)
        text = (helps or {}).get(name, opt.help)
        if opt.kind == "bool":
            if default:
                parser.add_argument(flag(f"no_{name}"), dest=name, action="store_false",
                                    help=(helps or {}).get(name, f"do not {opt.help}"))
            else:
                parser.add_argument(flag(name), action="store_true", help=text)
        elif opt.kind == "tristate":
            parser.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=None, help=text)
        elif opt.kind == "pins":
            parser.add_argument(flag(name.rstrip("s")), action="append", default=[], metavar=opt.metavar,
                                help=text)
        else:
            shown = f" (default {default})" if default not in (None, "") else ""
            parser.add_argument(flag(name), type=_parser(name, opt), default=default, choices=opt.choices,
                                metavar=opt.metavar, help=text + shown, required=name in required)


def add_size_arguments(parser, helps: dict[str, str] | None = None) -> None:
    """The proxy's size: --experts or --keep-ratio, one of them required (build, plan, bisect's probes)."""
    add_arguments(parser.add_mutually_exclusive_group(required=True), PruningOptions, only=("experts", "keep_ratio"),
                  helps=helps)


class _Collect(argparse.Action):
    """A flag of another command, kept as written in the namespace's list `into` (add_pass_through)."""

    into = "flags"

    def __call__(self, parser, namespace, values, option_string=None):
        tokens = [] if values is None else [values] if isinstance(values, str) else list(values)
        setattr(namespace, self.into, [*(getattr(namespace, self.into, None) or []), option_string, *tokens])


def add_pass_through(parser, cls, into: str, only: tuple[str, ...] | set[str] | None = None,
                     skip: tuple[str, ...] | set[str] = ()) -> None:
    """Flags for the options of `cls` that are collected as written, in order, into the
    namespace's list `into` (diagnose and bisect hand them to the runs they start, whose own
    parse checks them: `parse_flags` before anything runs)."""
    action = type(f"Into_{into}", (_Collect,), {"into": into})
    for name, opt, default in _selected(cls, None if only is None else tuple(only), skip):
        valued = opt.kind not in ("bool", "tristate")
        parser.add_argument(*spelled(name, opt, default), action=action, nargs=None if valued else 0,
                            dest=f"{into}_{name}", metavar=(opt.metavar or name.upper()) if valued else None,
                            help=opt.help, choices=opt.choices)


class _Refusing(argparse.ArgumentParser):
    """A parser that raises instead of printing usage and exiting: a bad flag is one line."""

    def error(self, message: str):
        raise InvalidOptions(message)


def parse_flags(argv: list[str], declare: Callable[[argparse.ArgumentParser], None]) -> argparse.Namespace:
    """`argv`, flags only, read as the command whose flags `declare` adds reads them, each value
    checked; a bad or unknown flag raises InvalidOptions (one line; nothing prints or exits).
    Turn the namespace into options models with `from_args`."""
    parser = _Refusing(prog="moe-proxy", add_help=False)
    declare(parser)
    return parser.parse_args(argv)


def from_args(cls, args: argparse.Namespace, **extra):
    """The options dataclass from parsed flags (pins merged from every --pin)."""
    values = {}
    for name, opt, _ in options_of(cls):
        if opt.kind == "pins" and hasattr(args, name.rstrip("s")):  # --pin 3:17,10:5 --pin 4:1
            values[name] = _merge_pins([_pin_items(text) for text in getattr(args, name.rstrip("s"))])
        elif hasattr(args, name):
            values[name] = getattr(args, name)
    return cls(**values | extra)


def to_args(options, only: tuple[str, ...] | None = None, skip: tuple[str, ...] = (),
            always: tuple[str, ...] = ()) -> list[str]:
    """The CLI flags that give `options`: each option that differs from its default (and those
    in `always`), in declaration order."""
    args: list[str] = []
    for name, opt, default in options_of(type(options)):
        if (only is not None and name not in only) or name in skip:
            continue
        value = getattr(options, name)
        if value == default and name not in always:
            continue
        if opt.kind == "bool":
            args += [flag(name) if value else flag(f"no_{name}")]
        elif opt.kind == "tristate":
            args += [] if value is None else [flag(name) if value else flag(f"no_{name}")]
        elif opt.kind == "pins":
            items = [f"{layer}:{e}" for layer, experts in sorted(value.items()) for e in experts]
            args += [flag(name.rstrip("s")), ",".join(items)] if items else []
        elif value is not None:
            args += [flag(name), f"{value:g}" if isinstance(value, float) else str(value)]
    return args


def from_crd(cls, raw: dict, where: str, **extra):
    """The options dataclass from a ProxyModel section (camelCase fields), each value checked
    as the CRD's schema would; InvalidOptions names the field (`where`.field)."""
    values = {}
    for name, opt, default in options_of(cls):
        if opt.crd is not None and raw.get(opt.crd) is None and opt.crd_default is not None:
            values[name] = opt.crd_default
        if opt.crd is None or raw.get(opt.crd) is None:
            continue
        value, path = raw[opt.crd], f"{where}.{opt.crd}"
        if opt.kind == "pins":
            if not isinstance(value, list):
                raise InvalidOptions(f"{path} {value!r}: a list of LAYER:EXPERT")
            values[name] = _merge_pins([_pin_items(str(v), path) for v in value])
            continue
        values[name] = _checked(value, opt, path)
    return cls(**values | extra)


def crd_properties(cls) -> dict[str, dict]:
    """The CRD schema of the options of `cls` that a ProxyModel has (structural OpenAPI v3)."""
    props = {}
    for name, opt, default in options_of(cls):
        if opt.crd is None:
            continue
        if opt.kind == "count":
            s: dict = {"x-kubernetes-int-or-string": True,
                       "x-kubernetes-validations": [{"rule": "type(self) == string ? self == 'auto' : self >= 1",
                                                     "message": f"{opt.crd} is \"auto\" or a whole number of at "
                                                                f"least 1"}]}
        elif opt.kind == "pins":
            s = {"type": "array", "maxItems": 4096, "items": {"type": "string", "pattern": PIN.pattern}}
        else:
            s = {"type": {"int": "integer", "float": "number", "str": "string"}.get(opt.kind, "boolean")}
            if opt.choices:
                s["enum"] = list(opt.choices)
            if opt.minimum is not None:
                s["minimum"] = opt.minimum
            if opt.above is not None:
                s |= {"minimum": opt.above, "exclusiveMinimum": True}
            if opt.maximum is not None:
                s["maximum"] = opt.maximum
            default = opt.crd_default if opt.crd_default is not None else default
            # (no float defaults: YAML writers disagree on 1e-05, Helm's turns it into a string; the
            # operator applies the model's default, so the schema need not)
            if default is not None and opt.kind in ("int", "str", "bool"):
                s["default"] = default
        props[opt.crd] = s | opt.crd_schema | {"description": opt.help}
    return props


def _checked(value: Any, opt: Opt, path: str) -> Any:
    if opt.kind == "count":
        if value == "auto":
            return value
        opt = Opt("int", opt.help, minimum=1)
    wanted = {"int": int, "float": (int, float), "str": str, "bool": bool, "tristate": bool}[opt.kind]
    if isinstance(value, bool) != (wanted is bool) or not isinstance(value, wanted):
        raise InvalidOptions(f"{path} {value!r}: expected {'a whole number' if opt.kind == 'int' else opt.kind}")
    if opt.choices and value not in opt.choices:
        raise InvalidOptions(f"{path} {value!r}: expected one of {', '.join(opt.choices)}")
    if (why := _out_of_range(value, opt)) is not None:
        raise InvalidOptions(f"{path} {value!r}: {why}")
    return float(value) if opt.kind == "float" else value


def _out_of_range(value, opt: Opt) -> str | None:
    if opt.minimum is not None and value < opt.minimum:
        return f"must be at least {opt.minimum:g}"
    if opt.above is not None and not value > opt.above:
        return f"must be above {opt.above:g}"
    if opt.maximum is not None and value > opt.maximum:
        return f"must be at most {opt.maximum:g}"
    return None


def _parser(name: str, opt: Opt):
    def parse(text: str):
        if opt.kind == "count" and text == "auto":
            return text
        try:
            value = {"int": int, "count": int, "float": float}.get(opt.kind, str)(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole number' if opt.kind != 'float' else 'a number'}"
                                             f"{' or auto' if opt.kind == 'count' else ''}, got {text!r}") from None
        if (why := _out_of_range(value, opt)) is not None:
            raise argparse.ArgumentTypeError(f"{text}: {why}")
        return value
    parse.__name__ = opt.kind  # argparse names the type in its messages
    return parse


def _pin_items(text: str, where: str = "--pin") -> list[tuple[int, int]]:
    items = []
    for item in filter(None, text.split(",")):
        if not PIN.match(item.strip()):
            raise InvalidOptions(f"{where} {item!r}: expected LAYER:EXPERT, e.g. 3:17")
        layer, expert = item.strip().split(":")
        items.append((int(layer), int(expert)))
    return items


def _merge_pins(groups: list) -> dict[int, list[int]]:
    pins: dict[int, list[int]] = {}
    for group in groups:
        for layer, expert in group:
            pins.setdefault(layer, []).append(expert)
    return pins


# Every command's flags that no options model declares, each with why no resource has it as a
# field or where a resource says the same (the one list; tests/chart/test_options.py checks that
# every flag of every command is an option or listed here, and that nothing listed is gone).
_DEVICES = "the operator plans devices from spec.reproduction.accelerator"
_OUT = "where this command writes; the operator chooses its children's locations"
_LOCAL = "a terminal command; the operator has no resource for it"
_SEARCH = "spec.bisection's watch (a CheckpointWatch's spec.pattern and spec.stepRegex)"
_STEP = "the operator's plan times the RL step with step_cost.StepShape's defaults"
CLI_ONLY: dict[str, dict[str, str]] = {
    "build": {
        "--max-experts": "the operator passes the count its plan sized the devices for (experts auto)",
        "--accelerator": _DEVICES, "--device-memory-gb": _DEVICES, "--devices-per-node": _DEVICES,
        "--max-devices": _DEVICES,
        "--overwrite": "the operator builds into its own destination, never over a user's files",
        "--workers": "spec.transformer.parallelism", "--worker": "spec.transformer.parallelism (the Job's index)",
        "--finalize": "spec.transformer.parallelism (the finalize Job)",
        "--fit": "spec.transformer.parallelism (the fit Job before the workers)",
    },
    "calibrate": {
        "--out": "the operator keeps statistics beside the proxy (<destination>-calibration/)",
        "--sequential": "spec.pruning.sequential", "--one-pass": "spec.pruning.sequential false",
    },
    "repro": {"--out": "the operator's reproduction writes to its pod's run directory"},
    "plan": {
        "--accelerator": _DEVICES, "--device-memory-gb": _DEVICES, "--devices-per-node": _DEVICES,
        "--max-devices": _DEVICES,
        "--micro-batch-tokens": "the operator plans with the planner's default micro-batch",
        "--no-reference": "the operator's plan counts the reference policy its reproduction has",
        **dict.fromkeys(("--sequences", "--prompt-tokens", "--response-tokens", "--updates", "--mfu",
                         "--hbm-efficiency", "--no-recompute"), _STEP),
    },
    "diagnose": {
        "--out": _OUT, "--candidates": "a Diagnosis's spec.candidates (catalogue names)",
        "--candidate": "a Diagnosis's spec.candidates (name and args)",
        "--candidates-file": "a Diagnosis's spec.candidates", "--list": _LOCAL,
        "--replace": "a Diagnosis's runs are its own children; a new spec starts over",
    },
    "bisect": {
        "--out": _OUT, "--pattern": _SEARCH, "--step-regex": _SEARCH,
        "--good": "a Diagnosis's spec.bisection.good", "--bad": "a Diagnosis's spec.bisection.bad",
        "--replace": "a Diagnosis's probes are its own children; a new spec starts over",
    },
    "triage": {  # the loop on one machine; on a cluster a watched run's Diagnosis (ARCHITECTURE.md, the closed loop)
        "--out": _OUT, "--pattern": _SEARCH, "--step-regex": _SEARCH,
        **dict.fromkeys(("--format", "--profile", "--metric"), "how the original's metrics are read, as watch reads them"),
        **dict.fromkeys(("--candidates", "--candidate", "--candidates-file"), "a Diagnosis's spec.candidates"),
        "--replace": "a Diagnosis's children are its own; a new spec starts over",
    },
    "checkpoints": {"--pattern": "a CheckpointWatch's spec.pattern", "--step-regex": "a CheckpointWatch's spec.stepRegex",
                    "--before": _LOCAL, "--deep": _LOCAL},
    "watch": {  # the sidecar the operator adds to a reproduction's pod (reproduction.watcher)
        **dict.fromkeys(("--hold", "--ready-file", "--stop-file"), "the operator's watch sidecar sets it itself"),
        **dict.fromkeys(("--format", "--profile", "--metric"),
                        "the sidecar reads the runtime's metrics file with its framework's profile"),
        **dict.fromkeys(("--poll", "--timeout", "--until-file"), "the sidecar ends with its pod (SIGTERM)"),
        "--last-step": "the sidecar takes spec.reproduction.maxSteps",
    },
    "compare": dict.fromkeys(("--out", "--format", "--profile", "--metric", "--metrics", "--names", "--permutations"),
                             _LOCAL),
    "verify": {"--no-forward": _LOCAL},
    "inspect": {},
}
