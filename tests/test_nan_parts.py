"""NaN/inf from a part of the checkpoint is named as that part, before training (issue 45, item 3): the VAE's or the
text encoder's output while caching, and a model that gives a NaN loss on its very first step. Divergence advice
(the learning rate, alpha) is kept for a divergence this run's updates produced. Imports no ComfyUI."""
import math

import pytest
import torch

from trainer.errors import LeanLoRAError

from test_pure_torch_training import TinyAdapter, train


def _expect_named_before_training(tmp_path, adapter, says: str) -> None:
    with pytest.raises(LeanLoRAError, match=says) as error:
        train(tmp_path / "data", tmp_path / "loras", adapter)
    assert "diverged" not in str(error.value) and "learning rate" not in str(error.value)
    assert not list((tmp_path / "loras").glob("*.safetensors"))


def test_nan_from_the_vae_is_named_as_the_vae_before_training(tmp_path):
    adapter = TinyAdapter()
    encode = adapter.encode_image
    adapter.encode_image = lambda pixels: encode(pixels) * math.nan
    _expect_named_before_training(tmp_path, adapter, r"the checkpoint's VAE gave NaN/inf values encoding img_\d+\.png "
                                                     r"\(latent\).*nothing was trained. Load a working VAE")


def test_inf_from_the_text_encoder_is_named_as_the_text_encoder_before_training(tmp_path):
    adapter = TinyAdapter()
    encode = adapter.encode_text
    adapter.encode_text = lambda caption, width, height: {"context": encode(caption, width, height)["context"] * math.inf}
    _expect_named_before_training(tmp_path, adapter, r"the checkpoint's text encoder \(CLIP\) gave NaN/inf values "
                                                     r"encoding the caption .*\(context\).*Load a working text")


def test_a_nan_loss_at_the_first_step_is_not_blamed_on_the_learning_rate(tmp_path):
    """NaN weights where check_base_weights does not sample (it reads every 25th value of this table): the model
    gives NaN before any update, so the advice is the checkpoint or the precision, never the learning rate."""
    adapter = TinyAdapter()
    with torch.no_grad():
        table = adapter.base.time.weight.view(-1)
        sampled = torch.zeros_like(table, dtype=torch.bool)
        sampled[::max(1, table.numel() // 64)] = True
        table[~sampled] = math.nan
    with pytest.raises(LeanLoRAError, match=r"the loss was NaN/inf at step 1, the first this run computed, before "
                                            r"any of its updates.*check the checkpoint") as error:
        train(tmp_path / "data", tmp_path / "loras", adapter)
    assert "lower the learning rate" not in str(error.value) and "nothing was saved" in str(error.value)
