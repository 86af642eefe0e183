"""The `pdserve` command: one entry point for every role, the offline engine and the benchmarks."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pdserve.bench.commands import BENCH_COMMANDS, commands_help

# role -> module with `add_cli_args(parser)` and `main(args)`
ROLES = {
    "up": ("pdserve.launch.up", "start a local cluster: gateway + prefill and decode workers"),
    "gateway": ("pdserve.gateway.cli", "run the HTTP gateway alone"),
    "prefill": ("pdserve.prefill.cli", "run one prefill worker"),
    "decode": ("pdserve.decode.cli", "run one decode worker"),
}


def _generate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from pdserve.config import runtime_config_from_args
    from pdserve.model_source import ModelSourceError
    from pdserve.runtime.engine import Engine
    from pdserve.sampling_params import SamplingParams

    try:
        cfg = runtime_config_from_args(args)
        engine = Engine(cfg)
    except (ValueError, ModelSourceError) as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(engine.runner.loaded.folder)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    prompts = [tok(p).input_ids for p in args.prompt]
    try:
        outs = engine.generate(prompts, params)
    except ValueError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    for text, out in zip(args.prompt, outs):
        print(f"{text}{tok.decode(out.output_ids, skip_special_tokens=True)}")
        print(f"  [{len(out.output_ids)} tokens, finish {out.finish_reason}, {out.total_seconds:.2f} s]")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from pdserve.kernels import cpu_isa

    # PDSERVE_CPU_ISA: checked before anything runs, and torch's own kernels capped before torch starts
    # (in this process and, through the environment, in every worker it launches).
    try:
        cpu_isa.apply_torch_env()
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from pdserve.launch.flag import GENERATE
    from pdserve.launch.flags import add_flags

    gen = sub.add_parser("generate", help="generate offline with the engine (no servers)")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--log-level", default="warning")
    add_flags(gen, GENERATE)

    bench = sub.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(BENCH_COMMANDS),
        epilog=commands_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "which", choices=list(BENCH_COMMANDS), metavar="COMMAND", help="one of the commands below"
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    plan = sub.add_parser(
        "plan", help="the prefill/decode split with the best goodput, simulated from this host's profile"
    )
    plan.add_argument(
        "rest", nargs=argparse.REMAINDER, help="pdserve plan's own flags (pdserve plan -- --help)"
    )

    roles = {}
    for name, (module, help_text) in ROLES.items():
        p = sub.add_parser(name, help=help_text)
        roles[name] = (module, p)
    if argv and argv[0] == "plan":  # its own parser, all its flags
        from pdserve.plan.cli import main as plan_main

        logging.basicConfig(level="WARNING", format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return plan_main(argv[1:])
    # Only the chosen role's flags are built, so `pdserve generate` never imports the gateway.
    if argv and argv[0] in roles:
        module, p = roles[argv[0]]
        mod = importlib.import_module(module)
        mod.add_cli_args(p)
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=getattr(args, "log_level", "info").upper(),
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
        return int(mod.main(args) or 0)

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "warning").upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.command == "generate":
        return _generate(args)
    if args.command == "bench":
        mod = importlib.import_module(BENCH_COMMANDS[args.which].module)
        return int(mod.main(args.rest) or 0)

    return 2


if __name__ == "__main__":
    sys.exit(main())
