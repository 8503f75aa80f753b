"""Every value read from a file is checked before it is used (issue 34, item 1): a training state's LoRA and
optimizer tensors, step, losses, generator states and data position, a continue_from LoRA's up/down/alpha, and the
base model's weights. A bad value is a LeanLoRAError naming the file, the value and what to do, never a later
'training diverged' with the wrong advice or a bare StopIteration / ZeroDivisionError. Imports no ComfyUI."""
import math
import random

import pytest
import torch

from trainer.errors import LeanLoRAError
from trainer.lora.continue_from import check_file, continue_from_file
from trainer.settings import LoraSettings
from trainer.training_state import (STATE_SUFFIX, TrainingState, check_base_weights, check_resumable,
                                    check_state_values, load_training_state, save_training_state)

from test_lora_import import ATTENTION, NAMES, PRESETS, SD1, injected, kohya_file, write


def _state(step=3, **changes) -> TrainingState:
    """A state as a 3-step AdamW run writes it (2 images, batch 1)."""
    params = [torch.nn.Parameter(torch.randn(4, 16)), torch.nn.Parameter(torch.zeros(16, 4))]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    sum((p ** 2).sum() for p in params).backward()
    optimizer.step()
    values = dict(step=step, lora=[p.detach().clone() for p in params], optimizer_name="AdamW",
                  optimizer=optimizer.state_dict(), scaler=None,
                  rng={"sampler": torch.Generator().manual_seed(0).get_state(), "torch": torch.get_rng_state(),
                       "python": random.getstate()},
                  data={"order": [[1], [0]], "position": 1, "batch_size": 1}, losses=[0.5] * step,
                  fingerprints={"dataset": "d"}, output_name="x")
    values.update(changes)
    return TrainingState(**values)


def _round_trip(tmp_path, state) -> TrainingState:
    return load_training_state(save_training_state(tmp_path / f"edited{STATE_SUFFIX}", state))


def test_a_state_as_a_run_writes_it_passes(tmp_path):
    path = tmp_path / f"edited{STATE_SUFFIX}"
    check_state_values(_round_trip(tmp_path, _state()), path, images=2)


def _nan_lora():
    state = _state()
    state.lora[1][2, 3] = math.nan
    return state


def _nan_moment():
    state = _state()
    state.optimizer["state"][0]["exp_avg"][0, 0] = math.inf
    return state


def _group(**values):
    """A state whose optimizer's first param group holds `values` instead."""
    state = _state()
    state.optimizer["param_groups"][0].update(values)
    return state


def _negative_moment():
    state = _state()
    state.optimizer["state"][0]["exp_avg_sq"][0, 0] = -1.0
    return state


CASES = {  # a state edited or damaged -> what the error must say
    "nan_lora": (_nan_lora, r"NaN/inf values in its LoRA tensor 1 of 2 \(state.lora\[1\], shape \(16, 4\)\)"),
    "nan_optimizer": (_nan_moment, r"NaN/inf values in its optimizer state \(state.optimizer.state\[0\].exp_avg"),
    "negative_step": (lambda: _state(step=-3), r"its step is -3, not a count"),
    "losses_for_other_steps": (lambda: _state(losses=[0.5]), r"it records 1 losses for its 3 steps"),
    "nan_loss": (lambda: _state(losses=[0.5, math.nan, 0.4]), r"the loss of step 2 is nan"),
    "negative_position": (lambda: _state(data={"order": [[1], [0]], "position": -1, "batch_size": 1}),
                          r"its data position is -1; the epoch it records has 2 batches"),
    "position_past_the_epoch": (lambda: _state(data={"order": [[1], [0]], "position": 9, "batch_size": 1}),
                                r"its data position is 9"),
    "image_not_in_the_dataset": (lambda: _state(data={"order": [[7], [0]], "position": 1, "batch_size": 1}),
                                 r"its batch order names image 7, but the dataset has 2 images"),
    "empty_batch": (lambda: _state(data={"order": [[], [0]], "position": 1, "batch_size": 1}), r"batch order"),
    "zero_batch_size": (lambda: _state(data={"order": [[1], [0]], "position": 1, "batch_size": 0}),
                        r"data batch size is 0"),
    "nan_lr": (lambda: _state(optimizer={**_state().optimizer, "param_groups": [
        {**_state().optimizer["param_groups"][0], "lr": math.nan}]}), r"optimizer's lr is nan"),
    "rate_past_the_widget": (lambda: _group(initial_lr=1000.0), r"optimizer's initial_lr is 1000.0 \(param group 0\), "
                             r"not a rate from 0 to 10"),
    "betas_out_of_range": (lambda: _group(betas=(2, 5)), r"optimizer's betas is \(2, 5\) \(param group 0\), not "
                           r"numbers in \[0, 1\)"),
    "zero_eps": (lambda: _group(eps=0.0), r"optimizer's eps is 0.0 \(param group 0\), not a positive number"),
    "negative_second_moment": (_negative_moment, r"second moment state.optimizer.state\[0\].exp_avg_sq holds "
                               r"negative values"),
    "nan_loss_scale": (lambda: _state(scaler={"scale": math.nan}), r"fp16 loss scale is nan"),
    "truncated_generator": (lambda: _state(rng={**_state().rng, "sampler": torch.zeros(7, dtype=torch.uint8)}),
                            r"random generator state 'sampler' cannot be loaded"),
    "nan_validation_loss": (lambda: _state(validation_losses=[(2, math.nan)]), r"validation loss 0 is nan at step 2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_state_names_the_file_and_the_value(tmp_path, case):
    make, says = CASES[case]
    loaded = _round_trip(tmp_path, make())
    path = tmp_path / f"edited{STATE_SUFFIX}"
    with pytest.raises(LeanLoRAError, match=says) as error:
        check_state_values(loaded, path, images=2)
    assert str(path) in str(error.value) and "set resume to 'off'" in str(error.value)
    assert "diverged" not in str(error.value) and "learning rate" not in str(error.value)


def test_a_state_whose_lora_shapes_differ_names_the_file(tmp_path):
    state = _state()
    with pytest.raises(LeanLoRAError, match=r"cannot resume from edited.leanlora-state: its LoRA tensors do not have "
                                            r"this LoRA's shapes"):
        check_resumable(state, tmp_path / f"edited{STATE_SUFFIX}", {"dataset": "d"}, 10, checks=("dataset",),
                        lora_shapes=[(4, 16), (16, 8)])


# --- continue_from: up/down/alpha ---

def test_a_continue_from_lora_with_nan_weights_names_the_file_and_the_tensor(tmp_path):
    _, _, tensors = kohya_file(tmp_path, ATTENTION, "diffusers")
    key = "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = math.nan
    file = write(tmp_path / "nan_up.safetensors", tensors)
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    says = rf"continue_from 'nan_up.safetensors' holds NaN/inf values in '{key}': the file is damaged .* Pick another"
    with pytest.raises(LeanLoRAError, match=says):
        check_file(settings)  # the LoRA Config node: before any encoding
    with pytest.raises(LeanLoRAError, match=says):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -2.0])
def test_a_continue_from_lora_with_a_bad_alpha_is_a_clear_error_not_stop_iteration(tmp_path, alpha):
    file, _, _ = kohya_file(tmp_path, ATTENTION, "diffusers", alpha=alpha, name="bad_alpha.safetensors")
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    says = (r"continue_from 'bad_alpha.safetensors' (holds NaN/inf values in '[^']*\.alpha'( and \d+ more)?|has "
            r"alpha -2 for [^:]*): the file is damaged")
    with pytest.raises(LeanLoRAError, match=says):
        check_file(settings)
    with pytest.raises(LeanLoRAError, match=says):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


def test_a_base_model_with_nan_weights_is_named_before_training():
    unet = injected(ATTENTION)
    check_base_weights(unet)
    with torch.no_grad():
        unet.middle_block[0].weight.fill_(math.nan)
    with pytest.raises(LeanLoRAError, match=r"base model's weight 'middle_block.0.weight' holds NaN/inf values: the "
                                            r"checkpoint is damaged"):
        check_base_weights(unet)


def test_a_nan_alpha_in_the_metadata_of_a_file_without_alpha_tensors_is_a_clear_error(tmp_path):
    _, _, tensors = kohya_file(tmp_path, ATTENTION, "diffusers")
    file = write(tmp_path / "meta.safetensors", {k: v for k, v in tensors.items() if not k.endswith(".alpha")},
                 {"ss_network_alpha": "nan"})
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=r"continue_from 'meta.safetensors' has alpha nan for .*: the file is "
                                            r"damaged \(a LoRA's alpha is a positive number\); pick another"):
        check_file(settings)
