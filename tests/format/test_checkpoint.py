"""The checkpoint format: packing, config schema, latq-inspect, corrupted checkpoints
(each rejected with one documented message naming file and tensor), and fuzzing of the
validator with hypothesis (it raises FormatError or accepts — never crashes or hangs)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vllm_latq import format as fmt
from vllm_latq.format import FormatError
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.commands.inspect import inspect_main
from vllm_latq.format.files import INDEX_FILE, STATS_FILE
from vllm_latq.format.safetensors_file import SafetensorsFile, StoredTensor, write_safetensors
from vllm_latq.testing.header_edits import edit_entry, read_header, with_header
from vllm_latq.format.validate import validate_checkpoint
from vllm_latq.format.writer import write_index

# ----------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("cin", [1, 31, 32, 80, 144])
def test_pack_roundtrip(bits, cin):
    g = torch.Generator().manual_seed(bits * 1000 + cin)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    z = torch.randint(lo, hi, (7, cin), generator=g, dtype=torch.int32)
    q = fmt.pack(z, bits)
    assert q.dtype == torch.int32 and q.shape == (7, fmt.packed_words(cin, bits))
    assert torch.equal(fmt.unpack(q, bits, cin), z)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_whole_value_words_are_the_bit_plane_words(bits):
    """Packing's fast path (b divides 32) writes the words of its definition for any b."""
    from vllm_latq.format.packing import _bit_plane_words, _whole_value_words
    u = torch.randint(0, 2 ** bits, (3, 5, 32), generator=torch.Generator().manual_seed(bits))
    u[0, 0] = 2 ** bits - 1   # every bit set: the top word bit too
    assert torch.equal(_whole_value_words(u, bits), _bit_plane_words(u, bits))


def test_pack_3bit_layout():
    """Documented layout (docs/FORMAT.md): a tile of 32 values is one 96-bit little-endian
    integer, value k (offset binary u = z + 4) at bits [3k, 3k+3), split into 3 int32 words."""
    z = torch.tensor([[(k % 8) - 4 for k in range(32)]], dtype=torch.int32)
    big = sum(((k % 8) << (3 * k)) for k in range(32))
    words = [(big >> (32 * w)) & 0xFFFFFFFF for w in range(3)]
    words = [w - 2**32 if w >= 2**31 else w for w in words]
    assert fmt.pack(z, 3).tolist() == [words]


def test_pack_takes_int8_integers_at_8_bits():
    """RTN's clipped integers are int8: the full 8-bit grid packs (2^7 is not an int8)."""
    z = torch.tensor([[-128, 127, 0, -1]], dtype=torch.int8)
    assert torch.equal(fmt.unpack(fmt.pack(z, 8), 8, 4), z.int())


def test_pack_rejects_off_grid():
    with pytest.raises(ValueError, match="outside the 3-bit grid"):
        fmt.pack(torch.tensor([[4]], dtype=torch.int32), 3)


def test_csr_helpers():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(7, 40, generator=g) < 0.1
    mask[3] = False  # an empty row
    values = torch.randn(7, 40, generator=g)
    crow, col, val = fmt.csr_from_mask(mask, values)
    assert crow.dtype == torch.int32 and col.dtype == torch.int64 and val.dtype == values.dtype
    rows = fmt.csr_rows(crow)
    assert rows.dtype == torch.int64 and torch.equal(fmt.csr_rows(crow, col.numel()), rows)
    assert torch.equal(torch.stack([rows, col], 1), mask.nonzero())  # row-major order
    assert torch.equal(val, values[rows, col])
    e_crow, e_col, e_val = fmt.csr_from_mask(torch.zeros(2, 3, dtype=torch.bool), torch.ones(2, 3))
    assert e_crow.tolist() == [0, 0, 0] and e_col.numel() == 0 and fmt.csr_rows(e_crow).numel() == 0


def test_stored_tensors_are_copied_by_pieces_into_the_same_bytes(tmp_path):
    """A tensor given as stored in another file (a model's embedding and head at the end of a
    run) is copied by pieces, twice (checksum, then bytes), never read whole: the file is byte
    for byte the one written from the tensors themselves."""
    g = torch.Generator().manual_seed(0)
    t = {"embed": torch.randn(300, 64, generator=g).bfloat16(), "head": torch.randn(300, 64, generator=g).half(),
         "norm": torch.ones(64)}
    write_safetensors(tmp_path / "eager.safetensors", t)
    src = SafetensorsFile(tmp_path / "eager.safetensors")
    seen = []

    class Piecewise(StoredTensor):
        def pieces(self, size=1000):
            for b in super().pieces(size):
                seen.append(len(b))
                yield b

    write_safetensors(tmp_path / "copied.safetensors", {"embed": Piecewise(src, "embed"),
                                                        "head": Piecewise(src, "head"), "norm": t["norm"]})
    assert (tmp_path / "eager.safetensors").read_bytes() == (tmp_path / "copied.safetensors").read_bytes()
    assert max(seen) == 1000 and sum(seen) == 2 * 2 * 300 * 64 * 2   # two tensors, two passes, 2 bytes each
    f = SafetensorsFile(tmp_path / "copied.safetensors")
    assert all(torch.equal(f.get(k), v) for k, v in t.items())
    f.verify("embed")
    with pytest.raises(FormatError, match="missing"):
        src.stored("lm_head")


@pytest.mark.parametrize("bits", [2, 3, 5, 8])
def test_unpack_at_matches_unpack(bits):
    g = torch.Generator().manual_seed(bits)
    z = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (5, 77), generator=g, dtype=torch.int32)
    q = fmt.pack(z, bits)
    rows, cols = torch.randint(0, 5, (50,), generator=g), torch.randint(0, 77, (50,), generator=g)
    assert torch.equal(fmt.unpack_at(q, bits, rows, cols), z[rows, cols])


def test_layer_math_stays_on_the_input_device():
    """unpack, dequantize and csr_rows create every tensor on their inputs' device: on ``meta``
    a tensor made on the CPU cannot be mixed with the inputs (as on CUDA), so this fails if
    one is (the old unpack built its index tensors and its result on the CPU)."""
    meta = torch.device("meta")
    out, cin, bits, gs, nnz = 6, 70, 3, 32, 5
    q = torch.empty(out, fmt.packed_words(cin, bits), dtype=torch.int32, device=meta)
    scales = torch.empty(out, 3, dtype=torch.float16, device=meta)
    crow = torch.empty(out + 1, dtype=torch.int32, device=meta)
    col = torch.empty(nnz, dtype=torch.int16, device=meta)
    val = torch.empty(nnz, dtype=torch.float16, device=meta)
    z = fmt.unpack(q, bits, cin)
    assert (z.device, z.shape, z.dtype) == (meta, (out, cin), torch.int32)
    rows = fmt.csr_rows(crow, nnz)
    assert (rows.device, rows.shape, rows.dtype) == (meta, (nnz,), torch.int64)
    W = fmt.dequantize(q, scales, crow, col, val, bits, gs, cin)
    assert (W.device, W.shape, W.dtype) == (meta, (out, cin), torch.float32)
    t = {"qweight": q, "scales": scales, "outlier_crow": crow, "outlier_col": col, "outlier_val": val}
    assert fmt.dequantize_layer(t, "dense", (out, cin), bits, gs).device == meta


def _dense_layer(plant: bool):
    """A valid dense layer with outliers; ``plant`` puts the integer 1 under one of them."""
    g = torch.Generator().manual_seed(1)
    out, cin, bits, gs = 9, 70, 3, 32
    z = torch.randint(-4, 4, (out, cin), generator=g, dtype=torch.int32)
    mask = torch.rand(out, cin, generator=g) < 0.05
    z[mask] = 0
    crow, col, val = fmt.csr_from_mask(mask, torch.randn(out, cin, generator=g).half() * 9)
    if plant:
        r, c = mask.nonzero()[2].tolist()
        z[r, c] = 1
    t = {"qweight": fmt.pack(z, bits), "scales": (torch.rand(out, 3, generator=g) + 0.5).half(),
         "outlier_crow": crow, "outlier_col": col.to(fmt.col_dtype(cin)), "outlier_val": val}
    return t, (out, cin), bits, gs, z, mask


def test_dequantize_adds_outliers_to_the_grid_weights():
    t, shape, bits, gs, z, mask = _dense_layer(plant=False)
    fmt.validate_layer(t, "dense", shape, bits, gs, layer="L")
    W = fmt.dequantize_layer(t, "dense", shape, bits, gs)
    s = t["scales"].float().repeat_interleave(gs, 1)[:, : shape[1]]
    want = z.float() * s
    want[mask] = t["outlier_val"].float()
    assert torch.equal(W, want)
    from vllm_latq.kernels import weight  # the kernels' runtime form computes the same weights
    w = weight.from_dense_tensors(t, bits, gs, shape[1])
    assert torch.equal(weight.dequantize(w), W)


def test_validator_rejects_integer_under_outlier():
    """docs/FORMAT.md: the dense integer at an outlier position is 0 (readers add the outlier)."""
    t, shape, bits, gs, _, mask = _dense_layer(plant=True)
    r, c = mask.nonzero()[2].tolist()
    with pytest.raises(FormatError, match=rf"file x, tensor L.qweight: integer 1 under the outlier at row {r}, "
                                          rf"column {c} \(must be 0\)"):
        fmt.validate_layer(t, "dense", shape, bits, gs, layer="L", file="x")


def test_format_imports_no_solver_kernel_or_vllm():
    """The loader reads checkpoints (Huffman streams included) without the solver package."""
    import subprocess
    import sys
    code = ("import sys, vllm_latq.format, vllm_latq.format.checkpoint, vllm_latq.format.validate, "
            "vllm_latq.format.writer, vllm_latq.commands.inspect; "
            "bad = [m for m in sys.modules if m.startswith(('vllm_latq.quantize', 'vllm_latq.kernels', 'vllm.'))"
            " or m == 'vllm']; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# ----------------------------------------------------------------------------- config schema


def test_quantization_config_schema():
    qc = fmt.quantization_config("ssqr", bits=4, group_size=128, outlier_rate=0.01, order="act", damp=0.01,
                                 modules_not_converted=["lm_head"])
    assert qc == {"quant_method": "latq", "format_version": 1, "method": "ssqr", "bits": 4, "group_size": 128,
                  "outlier_rate": 0.01, "order": "act", "damp": 0.01, "modules_not_converted": ["lm_head"]}
    spec = fmt.parse_quantization_config(qc)
    assert spec.kind == "dense" and not spec.is_converted("lm_head") and spec.is_converted("model.layers.0.x")
    h = fmt.quantization_config("hptq", target_bits=3.125, order="min-pivot", damp=0.01)
    assert h["bits"] is None and h["target_bits"] == 3.125 and "outlier_rate" not in h
    assert fmt.quantization_config("rtn", bits=3, group_size=64)["order"] is None
    lb = fmt.quantization_config("ssqr", bits=4, group_size=128, outlier_rate=0.01, damp=0.01,
                                 layer_bits={"lm_head": 8})
    spec = fmt.parse_quantization_config(lb)
    assert lb["layer_bits"] == {"lm_head": 8} and spec.bits_of("lm_head") == 8 and spec.bits_of("model.x") == 4


@pytest.mark.parametrize("change,msg", [
    ({"format_version": 4}, "unsupported latq format_version 4"),
    ({"quant_method": "gptq"}, "quant_method is 'gptq'"),
    ({"method": "awq"}, "method is 'awq'"),
    ({"bits": 9}, "bits must be an integer in 2..8"),
    ({"group_size": 0}, r"group_size must be an integer in 1..1048576, got 0"),
    ({"group_size": 2 ** 31}, r"group_size must be an integer in 1..1048576, got 2147483648"),
    ({"outlier_rate": "1%"}, "outlier_rate must be a finite number"),
    ({"order": "random"}, "order is 'random'"),
    ({"layer_bits": {"lm_head": 9}}, r"layer_bits\['lm_head'\] must be an integer in 2..8"),
    ({"layer_bits": ["lm_head", 8]}, "layer_bits must be an object"),
    ({"method": "hptq", "target_bits": 3.0, "layer_bits": {"lm_head": 8}}, "layer_bits is for the dense methods"),
])
def test_quantization_config_rejects(change, msg):
    qc = fmt.quantization_config("ssqr", bits=4, group_size=128, outlier_rate=0.01, order="act", damp=0.01)
    with pytest.raises(FormatError, match=msg):
        fmt.parse_quantization_config({**qc, **change})


# ----------------------------------------------------------------------------- latq-inspect


def test_inspect_valid(tiny_checkpoints, capsys):
    for method in ("ssqr", "hptq"):
        d, results = tiny_checkpoints[method]
        assert inspect_main([str(d)]) == 0
        out = capsys.readouterr().out
        assert "model.layers.1.mlp.down_proj" in out and f"method {method}" in out and "OK:" in out
        assert "served cpu" in out and "served triton" in out and "served (what a decode step streams" in out
        assert inspect_main([str(d), "--json"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["totals"]["layers"] == 14 and rep["quantization_config"]["method"] == method
        assert [r["name"] for r in rep["layers"]] == list(results)  # module order
        served = rep["totals"]["served_bits_per_weight"]
        assert set(served) == {"cpu", "triton"} and all(r["served"]["triton"]["kernel"] == "triton"
                                                         for r in rep["layers"])
        # K = 80 is no multiple of the int4 op's groups: on CPU every layer is the bf16 fallback
        assert served["cpu"] == 16.0 and rep["totals"]["bits_per_weight"] < served["triton"] < 16.0
    d = tiny_checkpoints["ssqr"][0]
    assert inspect_main([str(d), "--no-served"]) == 0
    assert "served" not in capsys.readouterr().out


def test_inspect_module_runs(tiny_checkpoints):
    """``python -m vllm_latq.commands.inspect`` (what the latq-inspect entry point runs)."""
    import subprocess
    import sys
    d = tiny_checkpoints["ssqr"][0]
    r = subprocess.run([sys.executable, "-m", "vllm_latq.commands.inspect", str(d), "--no-decode"], capture_output=True,
                       text=True, cwd=Path(__file__).parents[2])
    assert r.returncode == 0 and "OK:" in r.stdout, r.stderr


def _copy(tiny_checkpoints, method, tmp_path) -> Path:
    d = tmp_path / method
    shutil.copytree(tiny_checkpoints[method][0], d)
    return d


def _rewrite(d: Path, name: str, fn):
    """Replace tensor ``name`` by ``fn(tensor)`` (checksums recomputed: structural tests)."""
    shard = Checkpoint(d).where[name]
    f = SafetensorsFile(d / shard)
    t = {n: f.get(n) for n in f.names()}
    t[name] = fn(t[name])
    write_safetensors(d / shard, t)


def _inspect_fails(d, capsys, *msgs, args=()):
    assert inspect_main([str(d), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for m in msgs:
        assert m in err, err
    return err


L0 = "model.layers.0.self_attn.q_proj"
SHARD0 = "model-00001-of-00003.safetensors"


def _flip_data_byte(d, name):
    f = SafetensorsFile(d / SHARD0)
    e = f.entries[name]
    raw = bytearray((d / SHARD0).read_bytes())
    raw[f.data_start + e.begin] ^= 0x40
    (d / SHARD0).write_bytes(bytes(raw))


CORRUPTIONS = {
    # name: (mutation(d), expected fragments of the one error line)
    "truncated": (lambda d: (d / SHARD0).write_bytes((d / SHARD0).read_bytes()[:-100]),
                  [SHARD0, "truncated"]),
    "header": (lambda d: (d / SHARD0).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"
                                                   + b"\x00" * 64), [SHARD0, "header is not valid JSON"]),
    "flipped byte": (lambda d: _flip_data_byte(d, f"{L0}.qweight"),
                     [SHARD0, f"tensor {L0}.qweight", "sha256 mismatch"]),
    "missing shard": (lambda d: (d / SHARD0).unlink(), [INDEX_FILE, SHARD0, "missing"]),
    "format version": (lambda d: _edit_config(d, lambda c: c["quantization_config"].update(format_version=4)),
                       ["config.json", "unsupported latq format_version 4"]),
    "config shape": (lambda d: _edit_config(d, lambda c: c.update(intermediate_size=208)),
                     [SHARD0, "tensor model.layers.0.mlp.gate_proj.qweight",
                      "shape (144, 12), expected (208, 12)"]),
    "scales dtype": (lambda d: _rewrite(d, f"{L0}.scales", lambda x: x.float()),
                     [SHARD0, f"{L0}.scales", "dtype torch.float32, expected torch.float16"]),
    "qweight shape": (lambda d: _rewrite(d, f"{L0}.qweight", lambda x: x[:, :-1].contiguous()),
                      [f"{L0}.qweight", "shape (80, 11), expected (80, 12)"]),
    "csr column": (lambda d: _rewrite(d, f"{L0}.outlier_col", lambda x: x + 100),
                   [f"{L0}.outlier_col", "column index out of range [0, 80)"]),
    "csr rows": (lambda d: _rewrite(d, f"{L0}.outlier_crow", lambda x: x.flip(0)),
                 [f"{L0}.outlier_crow", "must start at 0 and end at nnz"]),
    "outlier integer": (lambda d: _plant_outlier_integer(d), [".qweight", "under the outlier", "(must be 0)"]),
    "nan scale": (lambda d: _rewrite(d, f"{L0}.scales", lambda x: x.index_fill(1, torch.tensor([0]), float("nan"))),
                  [f"{L0}.scales", "NaN/Inf"]),
    "missing tensor": (lambda d: _drop(d, "model.norm.weight"), ["missing tensors ['model.norm.weight']"]),
    "unexpected tensor": (lambda d: _add(d, "model.layers.0.extra.weight"),
                          [SHARD0, "model.layers.0.extra.weight", "unexpected tensor"]),
    "budget": (lambda d: _edit_config(d, lambda c: c["quantization_config"].update(outlier_rate=0.001)),
               [".outlier_col", "exceeds the budget 0.001"]),
    "config value": (lambda d: _edit_config(d, lambda c: c.update(hidden_size="abc")),
                     ["config.json", "transformers rejects the config"]),
    "config dims": (lambda d: _edit_config(d, lambda c: c.update(hidden_size=-4)),
                    ["config.json", "hidden_size is -4, expected an integer in [1, "]),
    "stats": (lambda d: _edit_json(d / STATS_FILE, lambda s: s["layers"][0].update(bits=9.0)),
              [STATS_FILE, "disagree with the stored tensors"]),
}
HUFFMAN_CORRUPTIONS = {
    "kraft": (lambda d: _rewrite(d, f"{L0}.hlengths", lambda x: torch.ones_like(x)),
              [f"{L0}.hlengths", "Kraft"]),
    "stream": (lambda d: _rewrite(d, f"{L0}.hstream", lambda x: x[:-3].contiguous()),
               [f"{L0}.hstream", "stream"]),
    "chunk table": (lambda d: _rewrite(d, f"{L0}.hchunk_bits", lambda x: x.flip(0).contiguous()),
                    [f"{L0}.hstream", "stream does not decode"]),
    "budget": (lambda d: _edit_config(d, lambda c: c["quantization_config"].update(target_bits=3.0)),
               [".hstream", "exceed target_bits 3.0"]),
}


def _plant_outlier_integer(d):
    """Put the integer 1 under the first outlier of the first layer that has one."""
    ck = Checkpoint(d)
    bits = ck.spec.bits
    for module in ck.layers():
        t = ck.layer_tensors(module)
        if t["outlier_col"].numel():
            break
    else:
        raise AssertionError("the tiny SSQR checkpoint has no outliers")
    cin = int(t["qweight"].shape[1] // bits * fmt.PACK_TILE)
    z = fmt.unpack(t["qweight"], bits, cin)
    r = int(fmt.csr_rows(t["outlier_crow"])[0])
    z[r, int(t["outlier_col"][0])] = 1
    _rewrite(d, f"{module}.qweight", lambda x: fmt.pack(z, bits))


def _edit_json(path, fn):
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def _edit_config(d, fn):
    _edit_json(d / "config.json", fn)


def _drop(d, name):
    ck = Checkpoint(d)
    shard = ck.where[name]
    f = SafetensorsFile(d / shard)
    write_safetensors(d / shard, {n: f.get(n) for n in f.names() if n != name})
    write_index(d, sorted(set(ck.where.values())))


def _add(d, name):
    ck = Checkpoint(d)
    f = SafetensorsFile(d / SHARD0)
    write_safetensors(d / SHARD0, {**{n: f.get(n) for n in f.names()}, name: torch.zeros(3)})
    write_index(d, sorted(set(ck.where.values())))


CORRUPTIONS_OF = {"ssqr": CORRUPTIONS, "hptq": HUFFMAN_CORRUPTIONS}   # a dense and a huffman checkpoint


@pytest.mark.parametrize("method,case", [(m, c) for m, t in CORRUPTIONS_OF.items() for c in sorted(t)])
def test_corrupted_checkpoint(method, case, tiny_checkpoints, tmp_path, capsys):
    d = _copy(tiny_checkpoints, method, tmp_path)
    mutate, msgs = CORRUPTIONS_OF[method][case]
    mutate(d)
    _inspect_fails(d, capsys, *msgs)


def test_flipped_payload_byte_without_checksums(tiny_checkpoints, tmp_path, capsys):
    """Without the checksums a flipped Huffman payload bit either breaks a chunk's length
    (rejected) or decodes to other integers (undetectable by structure: why the checksums)."""
    d = _copy(tiny_checkpoints, "hptq", tmp_path)
    _flip_data_byte(d, f"{L0}.hstream")
    _inspect_fails(d, capsys, f"{L0}.hstream", "sha256 mismatch")
    rc = inspect_main([str(d), "--no-checksums"])
    err = capsys.readouterr().err
    assert rc == 0 or (rc == 2 and "stream does not decode" in err)


def test_eval_rejects_corrupted_checkpoint(tiny_checkpoints, tmp_path, capsys):
    from vllm_latq.commands import evaluate
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    (d / SHARD0).write_bytes((d / SHARD0).read_bytes()[:1000])
    assert evaluate.main([str(d), "--nwindows", "1", "--seqlen", "32"]) == 2
    assert "truncated" in capsys.readouterr().err


# ----------------------------------------------------------------------------- fuzzing

_FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_dirs(tiny_checkpoints, tmp_path_factory):
    """Working copies of both checkpoints; each fuzz example mutates one file and restores it."""
    root = tmp_path_factory.mktemp("fuzz")
    out = {}
    for m in ("ssqr", "hptq"):
        shutil.copytree(tiny_checkpoints[m][0], root / m)
        out[m] = root / m
    return out


def _validate_or_format_error(d, **kw):
    try:
        validate_checkpoint(d, **kw)
    except FormatError as e:
        event(f"FormatError: {str(e).split(': ', 1)[-1][:30]}")
        return False
    event("valid")
    return True


# func_only: the limit is the test's own; the shared checkpoints that a first test builds or
# waits for (another worker building them, on a loaded machine) are not in it
@pytest.mark.timeout(600, func_only=True)
@_FUZZ
@given(method=st.sampled_from(["ssqr", "hptq"]),
       shard=st.sampled_from([SHARD0, "model-00002-of-00003.safetensors"]),
       flips=st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 255), st.booleans()), min_size=1, max_size=4),
       truncate=st.one_of(st.none(), st.integers(0, 2**31)),
       checksums=st.booleans())
def test_fuzz_file_bytes(fuzz_dirs, method, shard, flips, truncate, checksums):
    """Random byte flips (biased towards the JSON header) and truncations of a shard."""
    d = fuzz_dirs[method]
    path = d / shard
    orig = path.read_bytes()
    raw = bytearray(orig)
    hdr = 8 + int.from_bytes(orig[:8], "little")
    for pos, x, in_header in flips:
        raw[pos % hdr if in_header else pos % len(raw)] ^= x
    if truncate is not None:
        raw = raw[: truncate % len(raw)]
    try:
        path.write_bytes(bytes(raw))
        _validate_or_format_error(d, verify_checksums=checksums)
    finally:
        path.write_bytes(orig)


_DTYPES = [torch.int32, torch.int16, torch.uint8, torch.float16, torch.float32, torch.bfloat16, torch.int64]


def _mutate(x: torch.Tensor, kind: str, dtype, size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "dtype":
        return x.to(dtype)
    if kind == "shape":  # reshape to 1-D / add a dimension / resize
        flat = x.reshape(-1)
        if size % 3 == 0:
            return flat.contiguous()
        if size % 3 == 1:
            return x.unsqueeze(0).contiguous()
        n = size % (2 * flat.numel() + 3)
        return torch.cat([flat, flat])[:n].contiguous() if n <= 2 * flat.numel() else flat
    if kind == "values":  # same dtype and shape, random contents
        if x.is_floating_point():
            return (torch.randn(x.shape, generator=g) * 10 ** (size % 5)).to(x.dtype)
        info = torch.iinfo(x.dtype)
        hi = min(info.max, 2 ** (size % 20 + 1))
        return torch.randint(max(info.min, -hi), hi, x.shape, generator=g).to(x.dtype)
    # "edit": change a single element
    y = x.clone().reshape(-1)
    if y.numel():
        i = size % y.numel()
        y[i] = y[i] + (1 + seed % 7) * (-1) ** seed
    return y.reshape(x.shape)


@pytest.mark.timeout(600, func_only=True)
@settings(max_examples=500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(method=st.sampled_from(["ssqr", "hptq"]), layer=st.sampled_from([L0, "model.layers.1.mlp.down_proj"]),
       muts=st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["dtype", "shape", "values", "edit"]),
                               st.sampled_from(_DTYPES), st.integers(0, 10**6), st.integers(0, 10**6)),
                     min_size=1, max_size=3))
def test_fuzz_layer_tensors(tiny_checkpoints, method, layer, muts):
    """Random shape / dtype / value mutations of a layer's tensors: validate_layer raises
    FormatError or accepts, and what it accepts dequantizes without error."""
    d, results = tiny_checkpoints[method]
    ck = Checkpoint(d)
    t = ck.layer_tensors(layer)
    shape = tuple(results[layer].z.shape)
    names = sorted(t)
    for which, kind, dtype, size, seed in muts:
        n = names[which % len(names)]
        t[n] = _mutate(t[n], kind, dtype, size, seed)
    try:
        fmt.validate_layer(t, ck.spec.kind, shape, ck.spec.bits, ck.spec.group_size, layer=layer, file="x")
    except FormatError as e:
        assert str(e).startswith("file x, tensor ")
        event(f"FormatError: {str(e).split(': ', 1)[-1][:25]}")
        return
    event("valid")
    W = fmt.dequantize_layer(t, ck.spec.kind, shape, ck.spec.bits, ck.spec.group_size)
    assert W.shape == shape


@pytest.mark.timeout(600, func_only=True)
@_FUZZ
@given(method=st.sampled_from(["ssqr", "hptq"]), which=st.integers(0, 10**6),
       field=st.sampled_from(["dtype", "shape", "offsets", "drop", "rename"]),
       dtype=st.sampled_from(["F32", "F16", "BF16", "I32", "I16", "U8", "I64", "F8_E4M3", 7, None]),
       dims=st.lists(st.one_of(st.integers(-2, 300), st.just(2**62), st.text(max_size=2)), max_size=3),
       delta=st.integers(-64, 64), checksums=st.booleans())
def test_fuzz_header_entries(fuzz_dirs, method, which, field, dtype, dims, delta, checksums):
    """Valid-JSON mutations of one shard-header entry: dtype, shape, data offsets, a dropped
    or renamed tensor."""
    d = fuzz_dirs[method]
    path = d / SHARD0
    orig = path.read_bytes()
    header, n = read_header(orig)
    names = sorted(k for k in header if k != "__metadata__")
    edit_entry(header, names[which % len(names)], "end" if field == "offsets" else field, dtype=dtype, dims=dims,
               delta=delta)
    try:
        path.write_bytes(with_header(orig, n, header))
        _validate_or_format_error(d, verify_checksums=checksums)
    finally:
        path.write_bytes(orig)
