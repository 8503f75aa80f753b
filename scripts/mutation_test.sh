#!/usr/bin/env bash
# Mutation testing of the core trainer modules with mutmut (docs/TESTING.md has the last score and the survivors).
#
#   bash scripts/mutation_test.sh            # needs MUTMUT_VENV (default /tmp/leanlora-mutvenv) with mutmut 3
#
# mutmut copies the tree it runs in into mutants/, so it runs in a throwaway copy of this checkout: nothing it
# writes lands in the repository. Only the fast CPU unit tests run (never the ComfyUI server tests).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MUTMUT_VENV:-/tmp/leanlora-mutvenv}"
WORK="${MUTMUT_WORK:-/tmp/leanlora-mutation}"
MODULES="${MUTMUT_MODULES:-files lora step/precision loop objective dataset cache_store memory/ladder}"
TESTS="${MUTMUT_TESTS:-tests/test_trainer_units.py tests/test_cache_store.py tests/test_dataset.py tests/test_dataset_faults.py
    tests/test_train_faults.py tests/test_lr_schedules.py tests/test_lora_files.py tests/test_partial_checkpointing.py
    tests/test_mutation_kills.py}"
# Left out: CPU training runs of tens of seconds each (minutes on a loaded machine; every mutant of loop or
# precision would rerun them) and tests that load the tiny checkpoint into ComfyUI in-process.
DESELECT="${MUTMUT_DESELECT:-tests/test_trainer_units.py::test_loop_reduces_loss_in_every_precision
    tests/test_trainer_units.py::test_fp16_loss_scaling_skips_and_counts_overflowed_steps
    tests/test_trainer_units.py::test_reading_losses_every_n_steps_changes_nothing_but_the_syncs
    tests/test_train_faults.py::test_v_prediction_models_train_on_v_in_the_loss_itself
    tests/test_train_faults.py::test_a_diverging_run_stops_and_keeps_only_finite_weights
    tests/test_train_faults.py::test_a_hostile_name_is_sanitized_on_the_real_save_path
    tests/test_train_faults.py::test_alpha_other_than_rank_reaches_the_file
    tests/test_train_faults.py::test_the_report_states_the_batch_actually_used
    tests/test_train_faults.py::test_the_seed_reaches_noise_and_shuffling
    tests/test_train_faults.py::test_a_lora_already_on_the_input_model_is_baked_into_the_training_copy
    tests/test_train_faults.py::test_an_unwritable_loras_folder_fails_before_any_work_and_names_it
    tests/test_train_faults.py::test_a_loras_folder_that_fails_at_save_time_keeps_the_lora_in_the_fallback
    tests/test_train_faults.py::test_a_full_disk_at_save_time_keeps_the_lora_in_the_fallback
    tests/test_train_faults.py::test_an_unwritable_disk_cache_warns_and_trains_in_ram
    tests/test_train_faults.py::test_a_disk_cache_that_fills_up_while_caching_warns_and_trains_in_ram
    tests/test_lora_files.py::test_trained_sd15_file_loads_everywhere_with_every_key
    tests/test_lora_files.py::test_trained_file_metadata_is_kohyas
    tests/test_trainer_units.py::test_compile_leaves_the_resblocks_of_the_widest_level_eager
    tests/test_trainer_units.py::test_compile_preparation_splits_geglus_only_for_whole_layers
    tests/test_cache_store.py::test_encoder_ids_follow_weights_and_clip_patches
    tests/test_lr_schedules.py::test_the_pack_imports_no_diffusers}"
# (the last one imports the pack in a bare subprocess, where mutmut's trampolines cannot run)
# They go into pytest_add_cli_args, which mutmut appends to every pytest call (collection, the stats phase that maps
# tests to functions, each mutant's run).
if [ ! -x "$VENV/bin/mutmut" ]; then
    # A venv of its own that sees the project's packages (torch, ComfyUI's deps) through a .pth file.
    python3.11 -m venv "$VENV"
    site=$("$REPO/.venv/bin/python" -c "import site; print(site.getsitepackages()[0])")
    echo "$site" > "$VENV/lib/python3.11/site-packages/leanlora_project.pth"
    "$VENV/bin/pip" install -q "mutmut==3.8.1"
fi

rm -rf "$WORK"
mkdir -p "$WORK"
# tracked and new files; not the .venv/.cache links (git's ignore rules end in '/' and miss symlinks)
git -C "$REPO" ls-files -z --cached --others --exclude-standard | grep -zvE '^\.(venv|cache)$' \
    | (cd "$REPO" && xargs -0 cp -a --parents -t "$WORK")
cd "$WORK"
only=""
for m in $MODULES; do only+="    trainer/$m.py"$'\n'; done
tests=""
for t in $TESTS; do [ -f "$t" ] && tests+="    $t"$'\n'; done
deselect=""
for t in $DESELECT; do deselect+="    --deselect"$'\n'"    $t"$'\n'; done
cat > setup.cfg <<EOF
[mutmut]
source_paths = trainer/
only_mutate =
$only
pytest_add_cli_args_test_selection =
$tests
pytest_add_cli_args =
    -m
    not comfy
    -p
    no:randomly
${deselect}also_copy =
    scripts/
    nodes/
    bridge/
    __init__.py
    workflows/
    example_workflows/
process_isolation = forkserver
use_git_change_detection = false
debug = ${MUTMUT_DEBUG:-false}
# a mutant that loops forever is stopped after (its tests' time + 1 s) x this x 2 of CPU time (mutmut's default 15)
timeout_multiplier = ${MUTMUT_TIMEOUT_MULTIPLIER:-15}
EOF
export COMFYUI_PATH="${COMFYUI_PATH:-$REPO/.cache/comfyui}"
"$VENV/bin/mutmut" run --max-children "${MUTMUT_CHILDREN:-2}" || true
"$VENV/bin/mutmut" results --all true > "$WORK/results.txt" || true
grep -cE ": (killed|timeout)" "$WORK/results.txt" | sed 's/^/killed+timeout: /'
grep -E ": (survived|no tests)" "$WORK/results.txt" || true
echo "full results: $WORK/results.txt (mutmut show <name> in $WORK for a diff)"
