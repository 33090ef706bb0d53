"""Property: an edited checkpoint is refused, naming the file (and the tensor where a tensor was
edited), or it means exactly what it meant — never a silent change. Hypothesis edits real tiny
checkpoints (SSQR and RTN: dense; HPTQ: Huffman) in seven ways: a shard header's entry (dtype,
shape, offsets) or metadata, a config.json value (the model's or quantization_config's), a
latq_stats.json figure, a tensor's bytes (with its checksum left, or recomputed as a re-save
would), the bytes of a file sealed whole (tokenizer, generation config, chat template, index), a
value of the manifest itself, and a file added beside them. "Means the same" is checked in full:
the config and stats as values, every dequantized weight bitwise. The readers are the validator
(what inspect, eval and the vLLM plugin run) and, on a share of the examples, latq-export."""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm_latq.errors import FormatError
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.commands.export import export_checkpoint
from vllm_latq.format.files import MANIFEST_FILE, STATS_FILE
from vllm_latq.format.safetensors_file import SafetensorsFile, write_safetensors
from vllm_latq.format.validate import validate_checkpoint
from vllm_latq.testing.header_edits import edit_entry, read_header, with_header
from vllm_latq.testing.tiny_models import TINY_OPTS

METHODS = ("ssqr", "hptq", "rtn")
DTYPES = ["F32", "F16", "BF16", "I32", "I16", "U8", "I64", "I8"]
DELETE = object()   # a config or stats key removed
VALUES = st.one_of(st.integers(-3, 300), st.sampled_from([0.5, 1e-6, -1.0, 1e30, 64, 65, 128, 2**31]),
                   st.booleans(), st.none(), st.text(max_size=3), st.just(DELETE))


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Reference:
    """A working copy of a checkpoint and what it means: config, stats, dequantized weights;
    ``export``: latq-export reads each edit too."""

    def __init__(self, d: Path):
        self.dir = d
        self.export = False
        ck = Checkpoint(d)
        self.config, self.stats = ck.config, ck.stats()
        self.weights = dict(ck.dequantized_tensors(torch.float32))
        self.shards = sorted(ck.shards)
        self.where = dict(ck.where)


@pytest.fixture(scope="module")
def refs(tiny_checkpoints, tiny_llama, tmp_path_factory):
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    root = tmp_path_factory.mktemp("fuzz-integrity")
    dirs = {m: tiny_checkpoints[m][0] for m in ("ssqr", "hptq")}
    dirs["rtn"] = quantize_model(tiny_llama, root / "rtn-src", QuantizeOptions(method="rtn", **TINY_OPTS),
                                 progress=False)
    out = {}
    for m, d in dirs.items():
        shutil.copytree(d, root / m)
        out[m] = Reference(root / m)
    return out


def _check(ref: Reference, edited_file: str, tensor: str | None = None, names_a_tensor: bool = False) -> None:
    """The property, after one edit of ``edited_file`` (restored by the caller): a refusal names a
    file of the checkpoint (the edited shard, for a shard), ``tensor`` if given, some tensor if
    ``names_a_tensor``; an acceptance means the checkpoint still means what it meant."""
    try:
        validate_checkpoint(ref.dir)
    except FormatError as e:
        msg = str(e)
        if ref.export:   # the export refuses it too (a Huffman stream it decodes itself, maybe later), writing nothing
            with pytest.raises(ValueError):
                export_checkpoint(ref.dir, ref.dir.parent / "export", dequantize_unmapped=True)
            assert not list(ref.dir.parent.glob("export*"))
        event(f"refused: {msg.split(': ', 1)[-1][:28]}")
        assert msg.startswith("file ") and (ref.dir / msg[5:].split(",")[0].split(":")[0]).exists(), msg
        if edited_file.endswith(".safetensors"):
            assert f"file {edited_file}" in msg, msg
        if tensor is not None:
            assert f"tensor {tensor}" in msg, msg
        assert not names_a_tensor or ", tensor " in msg, msg
        return
    event("accepted")
    if ref.export:
        export_checkpoint(ref.dir, ref.dir.parent / "export", dequantize_unmapped=True)
        shutil.rmtree(ref.dir.parent / "export")
    ck = Checkpoint(ref.dir)
    assert ck.config == ref.config and ck.stats() == ref.stats
    got = dict(ck.dequantized_tensors(torch.float32))
    assert got.keys() == ref.weights.keys()
    for k, w in ref.weights.items():
        assert torch.equal(got[k], w), f"{k} changed silently after an edit of {edited_file}"


@contextmanager
def _restoring(path: Path):
    """The file's bytes, put back after the example whatever it did."""
    orig = path.read_bytes()
    try:
        yield orig
    finally:
        path.write_bytes(orig)


def _edit_metadata(header: dict, key_index: int, value: str | None) -> str:
    meta = header.setdefault("__metadata__", {})
    key = sorted(meta)[key_index % len(meta)] if meta else "format"
    if value is None:
        meta.pop(key, None)
    else:
        meta[key] = value
    return key


def header_edit(ref: Reference, data) -> None:
    shard = data.draw(st.sampled_from(ref.shards))
    path = ref.dir / shard
    with _restoring(path) as orig:
        header, n = read_header(orig)
        entry = data.draw(st.booleans())
        if entry:
            name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
            field = data.draw(st.sampled_from(["dtype", "shape", "end", "shift"]))
            before = json.loads(json.dumps(header[name]))
            edit_entry(header, name, field, dtype=data.draw(st.sampled_from(DTYPES)),
                       dims=data.draw(st.lists(st.integers(0, 300), max_size=3)), delta=data.draw(st.integers(-64, 64)))
            # an unchanged entry, or an empty tensor moved elsewhere (it reads the same nothing):
            # only the header's hash sees the rewrite, and names the file
            begin, end = before["data_offsets"]
            entry = header[name] != before and not (field == "shift" and begin == end)
        else:
            _edit_metadata(header, data.draw(st.integers(0, 10)), data.draw(st.one_of(st.none(), st.text(max_size=8))))
        path.write_bytes(with_header(orig, n, header))
        _check(ref, shard, names_a_tensor=entry)


def _json_edit(obj: dict, data, keys) -> None:
    key = data.draw(st.sampled_from(sorted(keys)))
    value = data.draw(VALUES)
    if value is DELETE:
        obj.pop(key, None)
    else:
        obj[key] = value


def config_edit(ref: Reference, data) -> None:
    path = ref.dir / "config.json"
    with _restoring(path):
        cfg = json.loads(path.read_text())
        target = cfg["quantization_config"] if data.draw(st.booleans()) else cfg
        _json_edit(target, data, [k for k in target if k != "quantization_config"])
        path.write_text(json.dumps(cfg))
        _check(ref, "config.json")


def stats_edit(ref: Reference, data) -> None:
    path = ref.dir / STATS_FILE
    with _restoring(path):
        stats = json.loads(path.read_text())
        layer = stats["layers"][data.draw(st.integers(0, len(stats["layers"]) - 1))]
        target = layer if data.draw(st.booleans()) else stats["totals"]
        _json_edit(target, data, target)
        path.write_text(json.dumps(stats))
        _check(ref, STATS_FILE)


def value_edit(ref: Reference, data) -> None:
    """A tensor's bytes changed in place (its checksum now wrong: the tensor is named), or the
    tensor replaced with its checksum recomputed, as a re-save writes it (the shard is named)."""
    name = data.draw(st.sampled_from(sorted(ref.where)))
    shard = ref.where[name]
    path = ref.dir / shard
    with _restoring(path) as orig:
        f = SafetensorsFile(path)
        e = f.entries[name]
        if e.end == e.begin:
            return
        pos = data.draw(st.integers(e.begin, e.end - 1))
        flip = data.draw(st.integers(1, 255))
        if data.draw(st.booleans()):
            raw = bytearray(orig)
            raw[f.data_start + pos] ^= flip
            path.write_bytes(bytes(raw))
            _check(ref, shard, tensor=name)
        else:
            t = {k: f.get(k) for k in f.names()}
            b = t[name].reshape(-1).view(torch.uint8)
            b[pos - e.begin] ^= flip
            write_safetensors(path, t, {k: v for k, v in f.metadata.items() if not k.startswith("latq_")})
            _check(ref, shard)


SEALED_WHOLE = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                "model.safetensors.index.json")


def whole_file_edit(ref: Reference, data) -> None:
    """A file sealed byte for byte: one byte flipped, the file cut short, or bytes appended."""
    name = data.draw(st.sampled_from([n for n in SEALED_WHOLE if (ref.dir / n).exists()]))
    path = ref.dir / name
    with _restoring(path) as orig:
        how = data.draw(st.sampled_from(["flip", "cut", "append"]))
        if how == "flip":
            raw = bytearray(orig)
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
            path.write_bytes(bytes(raw))
        else:
            path.write_bytes(orig[:data.draw(st.integers(0, len(orig) - 1))] if how == "cut" else orig + b" ")
        _check(ref, name)


def manifest_edit(ref: Reference, data) -> None:
    """A value of the manifest: a digest, a listed name, its version or author, a key removed."""
    path = ref.dir / MANIFEST_FILE
    with _restoring(path):
        m = json.loads(path.read_text())
        part = data.draw(st.sampled_from(["files", "shards", "config.json", "top"]))
        target = m if part == "top" else m[part]
        key = data.draw(st.sampled_from(sorted(target)))
        what = data.draw(st.sampled_from(["value", "rename", "drop"]))
        if what == "drop":
            del target[key]
        elif what == "rename":
            target[key + "x"] = target.pop(key)
        else:
            target[key] = data.draw(st.one_of(st.text(max_size=4), st.integers(0, 3), st.none(),
                                              st.just("0" * 64)))
        path.write_text(json.dumps(m))
        _check(ref, MANIFEST_FILE)


def added_file(ref: Reference, data) -> None:
    """A file or folder put beside the sealed ones: refused naming it, or (what no loader reads)
    accepted as it was."""
    name = data.draw(st.sampled_from(["chat_template.json", "preprocessor_config.json", "README.md",
                                      "extra.safetensors", "added_tokens.json", ".cache"]))
    path = ref.dir / name
    try:
        if name == ".cache":
            path.mkdir()
        else:
            path.write_bytes(data.draw(st.binary(max_size=16)))
        _check(ref, name)
    finally:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


EDITS = {"header": header_edit, "config": config_edit, "stats": stats_edit, "value": value_edit,
         "whole_file": whole_file_edit, "manifest": manifest_edit, "added": added_file}
EXAMPLES = {"header": 40, "config": 40, "stats": 20, "value": 40,   # kept small: the default suite runs them
            "whole_file": 20, "manifest": 20, "added": 10}


def _fuzz(refs, edit: str, examples: int) -> None:
    @_settings(examples)
    @given(method=st.sampled_from(METHODS), data=st.data())
    def prop(method, data):
        EDITS[edit](refs[method], data)
    prop()


L0 = "model.layers.0.self_attn.q_proj"
CLI_EDITS = {   # the fuzzer's kinds of edit, one each, through latq-inspect's own process: (method, tensor, edit)
    "header_dtype": ("ssqr", "model.norm.weight", dict(field="dtype", dtype="F16")),
    "header_shape": ("hptq", f"{L0}.hsymbols", dict(field="shape", dims=[3, 5])),
    "header_end": ("rtn", f"{L0}.scales", dict(field="end", delta=-2)),
    "value_byte": ("rtn", f"{L0}.qweight", None),
}


@pytest.mark.parametrize("case", sorted(CLI_EDITS))
def test_cli_exits_2_naming_file_and_tensor(refs, case):
    """What the property asserts of validate_checkpoint holds for the command: exit code 2, and
    its stderr names the edited shard and tensor."""
    import subprocess
    import sys
    method, name, edit = CLI_EDITS[case]
    ref = refs[method]
    shard = ref.where[name]
    path = ref.dir / shard
    with _restoring(path) as orig:
        if edit is None:   # a byte of the tensor flipped in place
            f = SafetensorsFile(path)
            raw = bytearray(orig)
            raw[f.data_start + f.entries[name].begin] ^= 0x5A
            path.write_bytes(bytes(raw))
        else:
            header, n = read_header(orig)
            edit_entry(header, name, **edit)
            path.write_bytes(with_header(orig, n, header))
        root = Path(__file__).resolve().parents[2]
        p = subprocess.run([sys.executable, "-m", "vllm_latq.commands.inspect", str(ref.dir), "--no-served"],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"file {shard}, tensor {name}: " in p.stderr, p.stderr[-2000:]


# func_only: the limit is the test's own; the shared checkpoints that a first test builds or
# waits for (another worker building them, on a loaded machine) are not in it
@pytest.mark.timeout(300, func_only=True)
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edits_are_refused_or_change_nothing(refs, edit):
    _fuzz(refs, edit, EXAMPLES[edit])


@pytest.mark.timeout(600, func_only=True)
def test_export_refuses_what_the_validator_refuses(refs):
    """latq-export reads an edited checkpoint as the validator does: the same refusal, and no
    output; or, accepted, an export of what the checkpoint meant."""
    for r in refs.values():
        r.export = True
    try:
        for edit in ("value", "whole_file", "added", "config"):
            _fuzz(refs, edit, 4)
    finally:
        for r in refs.values():
            r.export = False


@pytest.mark.slow
@pytest.mark.timeout(3600, func_only=True)
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edits_are_refused_or_change_nothing_long(refs, edit):
    _fuzz(refs, edit, 10 * EXAMPLES[edit])
