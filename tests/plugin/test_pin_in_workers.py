"""The pin holds in vLLM's workers: ``--load-format latq`` reads the weights in the process that loads
them from files it opened once and verified there, against the digest the plugin validated when vLLM
built its config and a pinned LATQ_EXPECT_DIGEST, each tensor hashed as read. A checkpoint swapped in
after the config-time check is refused naming the manifest; one swapped in once the loader opened its
files is not what it reads; a pin under vLLM's own loader (which reads the files again) is refused."""
from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.format.manifest import DIGEST_ENV, digest_of
from vllm_latq.format.swap_hook import SWAP_ENV
from vllm_latq.testing.header_edits import edit_bytes_in_place

from tests import vllm_helpers as h

pytest.importorskip("vllm")

from vllm_latq.plugin import config, weights  # noqa: E402
from vllm_latq.plugin.config import LatqCheckpointRefused  # noqa: E402

EDITED = "model.layers.0.mlp.down_proj.qweight"


def _tensors(path) -> dict[str, torch.Tensor]:
    ck = Checkpoint(path)
    return {n: ck.tensor(n) for n in ck.where}


def _load(a, validated):
    return dict(weights.verified_weights(str(a), None, validated))


def test_the_loader_reads_what_it_verified_through_a_swap(pair, monkeypatch):
    a, b, da, db = pair
    want = _tensors(a)
    monkeypatch.setenv(SWAP_ENV, str(b))   # swapped once the loader has opened and verified A
    got = _load(a, da)
    assert digest_of(a) == db and not b.exists()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert _tensors(a).keys() != want.keys()   # what is there now is the other checkpoint


def test_a_swap_after_the_config_time_check_is_refused_naming_the_manifest(pair, monkeypatch):
    a, b, da, db = pair
    os.rename(a, a.with_name("a.old"))
    os.rename(b, a)   # between maybe_update_config's check and the worker's load
    with pytest.raises(LatqCheckpointRefused) as e:
        _load(a, da)
    assert str(e.value) == (f"latq: {a} refused: file latq_manifest.json: the checkpoint's digest is {db}, not {da}, "
                            "the one checked when vLLM built its config: it was replaced after that check")
    monkeypatch.setenv(DIGEST_ENV, da)   # the worker honours the pin itself too
    with pytest.raises(LatqCheckpointRefused, match=rf"latq_manifest.json: the checkpoint's digest is {db}, not "
                                                    rf"the pinned {da}"):
        _load(a, None)


def test_bytes_edited_in_place_after_the_loaders_check_are_refused_naming_the_tensor(ck, monkeypatch):
    shard = Checkpoint(ck).where[EDITED]
    monkeypatch.setattr(weights, "swap_if_asked",
                        lambda path: edit_bytes_in_place(path / shard, EDITED, lambda t: t ^ 1))
    with pytest.raises(LatqCheckpointRefused) as e:
        _load(ck, digest_of(ck))
    assert str(e.value) == (f"latq: {ck} refused: file {shard}, tensor {EDITED}: sha256 mismatch: the bytes read are "
                            "not those written (edited or corrupted)")
    monkeypatch.setenv("LATQ_NO_VERIFY", "1")   # read as it is: the edit is served
    assert torch.equal(_load(ck, None)[EDITED], Checkpoint(ck).tensor(EDITED))


@pytest.mark.parametrize("load_format, pinned, refused", [("auto", True, True), ("latq", True, False),
                                                          ("auto", False, False)])
def test_a_pin_needs_latqs_loader(monkeypatch, load_format, pinned, refused):
    import vllm.config
    vllm_config = SimpleNamespace(load_config=SimpleNamespace(load_format=load_format))
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: vllm_config)
    if pinned:
        monkeypatch.setenv(DIGEST_ENV, "sha256:" + "1" * 64)
    else:
        monkeypatch.delenv(DIGEST_ENV, raising=False)
    if not refused:
        config.check_load_format()
        return
    with pytest.raises(LatqCheckpointRefused, match="LATQ_EXPECT_DIGEST pins the checkpoint, but --load-format auto "
                                                    "has vLLM read its files again"):
        config.check_load_format()


def test_the_validated_digest_travels_in_the_quantization_config(ck):
    qc = Checkpoint(ck).config["quantization_config"]
    hf = SimpleNamespace(quantization_config=dict(qc))
    config.LatqConfig.from_config(qc).maybe_update_config(str(ck), hf_config=hf)
    assert hf.quantization_config[config.DIGEST_KEY] == digest_of(ck)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_workers_load_what_was_pinned(tmp_path):
    """vLLM itself (in-process engine): latq's loader serves A as vLLM's own loader would (HF's greedy
    tokens on A's dequantized weights); A swapped for B right after the config-time check (the hook) is
    refused in the worker naming the manifest; a pin under vLLM's own loader and a bogus LATQ_KERNEL are
    refused with one line naming why."""
    src = h.make_tiny_llama(tmp_path / "model")   # head_dim 32: vLLM's CPU attention takes it
    a, b = h.quantize_dir(src, tmp_path / "a", "ssqr", bits=3), h.quantize_dir(src, tmp_path / "b", "rtn")
    da, db = digest_of(a), digest_of(b)
    for d in ("a2", "a3"):
        shutil.copytree(a, tmp_path / d)
    shutil.copytree(b, tmp_path / "b2")
    ids = h.tokenize(a)[:2]
    want = h.hf_greedy(h.hf_dequantized_model(a), ids, 8)
    job = {"prompt_ids": ids, "max_tokens": 8, "load_format": "latq"}
    res = h.run_vllm_jobs([
        {**job, "model": a, "env": {"LATQ_KERNEL": "reference", DIGEST_ENV: da}},
        {**job, "model": tmp_path / "a2", "env": {SWAP_ENV: str(b)}},
        {**job, "model": tmp_path / "a3", "env": {DIGEST_ENV: da, SWAP_ENV: str(tmp_path / "b2")}},
        {**job, "model": a, "env": {DIGEST_ENV: da}, "load_format": "auto"},
        {**job, "model": a, "env": {"LATQ_KERNEL": "bogus"}},
    ], tmp=tmp_path)
    assert res[0].get("tokens") == want, res[0].get("traceback")
    for i, d in ((1, "a2"), (2, "a3")):   # swapped after the config-time check that passed; refused in the worker
        assert digest_of(tmp_path / d) == db
        why = (f"not {da}, the one checked when vLLM built its config: it was replaced after that check" if i == 1
               else f"not the pinned {da}: it is not the checkpoint you pinned")
        assert res[i]["error"].startswith(f"LatqCheckpointRefused: latq: {tmp_path / d} refused: file "
                                          f"latq_manifest.json: the checkpoint's digest is {db}, {why}"), res[i]
    assert res[3]["error"].startswith("LatqCheckpointRefused: latq: LATQ_EXPECT_DIGEST pins the checkpoint, but "
                                      "--load-format auto"), res[3].get("traceback")
    assert res[4]["error"].startswith("LatqEnvironmentRefused: latq: environment variable LATQ_KERNEL='bogus': "
                                      "expected one of "), res[4].get("traceback")
