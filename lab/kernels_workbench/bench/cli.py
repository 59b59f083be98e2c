"""Command line: run a sweep on this machine and append it to ``data/measured/<loss>.csv``.

Examples::

    ./workbench bench kl_div --preset published          # the published workload (on a GPU)
    ./workbench bench kl_div --preset small              # the CPU-sized version
    ./workbench bench jsd --preset published_tokens      # a loss's second published chart (JSD's token sweep)
    ./workbench bench kl_div --x V --values 4096,50257 --size N=1024 --dtype bfloat16 \\
        --providers kernels_lib,torch --modes forward,full --dry-run
    ./workbench bench fused_linear_grpo_loss_token --option loss_type=cispo --option epsilon_high=5.0

An ``--option NAME=VALUE`` replaces one of the loss's options (its spec's ``default_options``; the
rows record every option in ``extra_benchmark_config_str``): VALUE is read as a Python literal
(``5.0``, ``None``, ``True``), else taken as a string (``cispo``).

The ceilings (copy bandwidth, matmul rate) are measured in the same run on CUDA and appended to
``data/measured/ceilings.csv``.
"""

from __future__ import annotations

import argparse
import ast
import sys

import torch

from .. import data
from kernels_lib._runtime import default_device
from .registry import get_spec, registered_losses
from .timing import MODES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _size(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if not name or not value.isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"expected NAME=POSITIVE_INT, got {text!r}")
    return name, int(value)


def _option(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not name or not sep or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value  # a bare word: a string option such as loss_type=cispo
    return name, parsed


def _device(text: str) -> torch.device:
    if text not in ("auto", "cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected auto, cpu or cuda, got {text!r}")
    device = default_device() if text == "auto" else torch.device(text)
    if device != default_device():
        raise argparse.ArgumentTypeError(f"kernels_lib runs on {default_device()} on this machine, not {text}")
    return device


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kernels-bench", description=__doc__.split("\n")[0])
    p.add_argument("loss", choices=registered_losses(), help="the loss, named as in the published CSV")
    p.add_argument(
        "--preset", help="published (the default on CUDA), small (its CPU-sized version, the default on CPU) "
        "or another published workload of the loss (jsd: published_tokens, the B200 token sweep)"
    )
    p.add_argument("--x", dest="x_name", help="the swept axis (default: the preset's)")
    p.add_argument("--values", type=_positive_ints, help="comma-separated points of the swept axis")
    p.add_argument("--size", type=_size, action="append", default=[], help="a fixed size, NAME=INT (repeatable)")
    p.add_argument("--dtype", choices=DTYPES, help="input dtype (default: the preset's)")
    p.add_argument("--option", type=_option, action="append", default=[],
                   help="a loss option, NAME=VALUE (repeatable; among the spec's default options)")
    p.add_argument("--providers", help="comma-separated providers (default: all that run here)")
    p.add_argument("--modes", default="forward,forward_no_grad,full", help=f"comma-separated, among {', '.join(MODES)}")
    p.add_argument("--device", type=_device, default="auto", help="auto (default), cpu or cuda")
    p.add_argument("--dry-run", action="store_true", help="print the rows, append nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    spec = get_spec(args.loss)
    try:
        preset = spec.preset(args.preset or ("published" if args.device.type == "cuda" else "small"))
    except ValueError as error:
        cli.error(str(error))
    providers = args.providers.split(",") if args.providers else None
    modes = args.modes.split(",")
    from .ceilings import measure_ceilings
    from .sweep import run_sweep

    # The loss's sizes are the preset's axis and fixed sizes: refuse another axis, and a swept
    # preset size whose place must then be taken by --size (else make_inputs fails with a KeyError).
    x_name = args.x_name or preset["x_name"]
    sizes = {**preset["sizes"], **dict(args.size)}
    axes = {preset["x_name"], *preset["sizes"]}
    if x_name not in axes:
        cli.error(f"--x must be one of {', '.join(sorted(axes))} for {args.loss}; got {x_name!r}")
    for name, _ in args.size:
        if name not in axes:
            cli.error(f"--size {name}: {args.loss} has no size {name!r}; its sizes are {', '.join(sorted(axes))}")
        if name == x_name:
            cli.error(f"--size {name}: {name} is the swept axis here; give its points with --values")
    for name, _ in args.option:
        if name not in spec.default_options and name not in spec.extra_options:
            known = sorted({*spec.default_options, *spec.extra_options})
            cli.error(f"--option {name}: {args.loss} has no option {name!r}; its options are {', '.join(known)}")
    missing = sorted(axes - {x_name} - set(sizes))
    if missing:
        cli.error(f"sweeping {x_name} needs the fixed size(s) {', '.join(missing)}: give --size NAME=INT")
    try:
        rows = run_sweep(
            args.loss,
            x_name=x_name,
            x_values=args.values or preset["x_values"],
            sizes=sizes,
            dtype=DTYPES[args.dtype] if args.dtype else preset["dtype"],
            device=args.device,
            providers=providers,
            modes=modes,
            options=dict(args.option),
            progress=lambda done, total, label: print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True),
        )
    except ValueError as error:  # unknown providers or modes
        cli.error(str(error))
    ceilings = measure_ceilings(args.device)
    shown = ["kernel_provider", "kernel_operation_mode", "metric_name", "x_value", "y_value_50", "y_value_20", "y_value_80"]
    print(rows[shown].to_string(index=False))
    if len(ceilings):
        print(ceilings[["kernel_name", "metric_unit", "y_value_50"]].to_string(index=False))
    if args.dry_run:
        return 0
    print(f"appended {len(rows)} rows to {data.append_measured(rows, args.loss)}")
    if len(ceilings):
        print(f"appended {len(ceilings)} rows to {data.append_measured(ceilings, 'ceilings')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
