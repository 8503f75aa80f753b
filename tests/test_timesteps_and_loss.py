"""Issue 35's timesteps and loss knobs (trainer/objective.py, TrainSettings): noise offset, min-SNR γ, timestep
sampling, Huber / smooth-L1. Each test fails when its knob is ignored; the defaults draw and score exactly as before
the knobs existed. Unit tests and seeded CPU runs on the pure-torch adapter (no ComfyUI); the last test runs the
Train node in the real server."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from test_pure_torch_training import EAGER, EpsSchedule, TinyAdapter
from trainer.dataset import scan_folder
from trainer.errors import LeanLoRAError
from trainer.model import FamilyIdentity
from trainer.objective import (PLAIN_MSE, LossFunction, LossKind, TimestepSampling, denoising_loss, draw_noise,
                               min_snr_weights, output_target, sample_sigmas)
from trainer.settings import LoraSettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import state_path


class Levels:
    """A schedule of 1001 evenly spaced noise levels: a drawn level's index / 1000 is its position in [0, 1]."""
    sigmas = torch.linspace(0.01, 10.01, 1001)


def positions(sampling: TimestepSampling, shift: float = 3.0, n: int = 50_000) -> torch.Tensor:
    drawn = sample_sigmas(Levels, n, torch.Generator().manual_seed(3), sampling, shift)
    return torch.searchsorted(Levels.sigmas, drawn).double() / 1000


QUANTILES = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
NORMAL = torch.distributions.Normal(0.0, 1.0)


def test_each_timestep_sampling_draws_its_distribution():
    """Empirical quantiles on 50,000 draws against each sampling's own quantile function."""
    logit_normal = torch.sigmoid(NORMAL.icdf(QUANTILES))  # sigmoid(z) at the normal's quantiles
    shift = 3.0
    expected = {TimestepSampling.UNIFORM: QUANTILES,
                TimestepSampling.LOGIT_NORMAL: logit_normal,
                TimestepSampling.SHIFTED_SIGMOID: logit_normal * shift / (1 + (shift - 1) * logit_normal)}
    for sampling, quantiles in expected.items():
        drawn = torch.quantile(positions(sampling, shift), QUANTILES)
        torch.testing.assert_close(drawn, quantiles, atol=0.01, rtol=0, msg=sampling.name)
    # the shift moves the draws towards the noisy end, more for a larger shift; a shift of 1 is logit-normal
    assert positions(TimestepSampling.SHIFTED_SIGMOID, 6.0).median() > positions(
        TimestepSampling.SHIFTED_SIGMOID, 3.0).median() > 0.7
    assert torch.equal(positions(TimestepSampling.SHIFTED_SIGMOID, 1.0), positions(TimestepSampling.LOGIT_NORMAL))


def test_noise_offset_adds_a_per_image_and_channel_constant_and_keeps_the_noise_levels():
    shape = torch.Size((3, 4, 8, 8))
    plain = draw_noise(EpsSchedule(), shape, torch.Generator().manual_seed(5))
    offset = draw_noise(EpsSchedule(), shape, torch.Generator().manual_seed(5), noise_offset=0.1)
    assert torch.equal(plain["sigma"], offset["sigma"]) and torch.equal(plain["timestep"], offset["timestep"])
    added = offset["noise"] - plain["noise"]
    per_channel = added[:, :, :1, :1]
    torch.testing.assert_close(added, per_channel.expand_as(added))  # constant over each channel's pixels
    assert per_channel.flatten().unique().numel() == 12  # a constant of its own per image and channel
    # kohya's: offset * N(0, 1) of shape (B, C, 1, 1), here drawn after the noise and the noise levels
    replay = torch.Generator().manual_seed(5)
    torch.randn(shape, generator=replay)
    sample_sigmas(EpsSchedule(), 3, replay)
    torch.testing.assert_close(per_channel, 0.1 * torch.randn(3, 4, 1, 1, generator=replay))


def _kohya_snr_weight(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor, gamma: float, v_prediction: bool):
    """kohya-ss/sd-scripts library/custom_train_functions.py: prepare_scheduler_for_custom_training and
    apply_snr_weight, on a DDPM schedule's alphas_cumprod."""
    alpha = torch.sqrt(alphas_cumprod)
    sigma = torch.sqrt(1.0 - alphas_cumprod)
    all_snr = (alpha / sigma) ** 2
    snr = torch.stack([all_snr[t] for t in timesteps])
    min_snr_gamma = torch.minimum(snr, torch.full_like(snr, gamma))
    return torch.div(min_snr_gamma, snr + 1 if v_prediction else snr).float()


def test_min_snr_weights_are_kohyas_on_known_sigmas():
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2  # SD's scaled-linear
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    sigmas = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5  # ComfyUI's ModelSamplingDiscrete.sigmas
    timesteps = torch.tensor([0, 10, 100, 300, 500, 700, 999])
    for gamma in (1.0, 5.0, 20.0):
        for v_prediction in (False, True):
            ours = min_snr_weights(sigmas[timesteps].float(), gamma, v_prediction)
            torch.testing.assert_close(ours, _kohya_snr_weight(timesteps, alphas_cumprod, gamma, v_prediction),
                                       rtol=1e-5, atol=1e-7)
    assert min_snr_weights(sigmas[timesteps].float(), 5.0, False)[0] < 0.01  # nearly clean: weighted down


def test_min_snr_weighting_scales_each_images_loss():
    g = torch.Generator().manual_seed(0)
    output, target = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    sigma = torch.tensor([0.05, 1.0, 10.0])
    per_image = ((output - target) ** 2).mean(dim=(1, 2, 3))
    for prediction, weights in (("epsilon", (1 / sigma ** 2).clamp(max=5) * sigma ** 2),
                                ("v", (1 / sigma ** 2).clamp(max=5) / (1 / sigma ** 2 + 1))):
        loss = LossFunction.of(LossKind.MSE, 0.1, 5.0, prediction)
        torch.testing.assert_close(loss(output, target, sigma), (per_image * weights).mean())
        assert not torch.allclose(loss(output, target, sigma), F.mse_loss(output, target))
    with pytest.raises(LeanLoRAError, match=r"min_snr_gamma: got 5, but this model is trained by flow matching.*"
                                            r"does not apply.*Set min_snr_gamma to 0"):
        LossFunction.of(LossKind.MSE, 0.1, 5.0, "flow")
    assert LossFunction.of(LossKind.MSE, 0.1, 0.0, "flow") == PLAIN_MSE  # off: any model


def test_huber_and_smooth_l1_are_torchs_own():
    g = torch.Generator().manual_seed(1)
    output, target = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    sigma = torch.ones(2)
    huber = LossFunction.of(LossKind.HUBER, 0.3, 0.0, "epsilon")(output, target, sigma)
    smooth = LossFunction.of(LossKind.SMOOTH_L1, 0.3, 0.0, "epsilon")(output, target, sigma)
    assert torch.equal(huber, F.huber_loss(output, target, delta=0.3))
    assert torch.equal(smooth, F.smooth_l1_loss(output, target, beta=0.3))
    mse = F.mse_loss(output, target)
    assert len({huber.item(), smooth.item(), mse.item()}) == 3
    # with min-SNR, each image's Huber mean is weighted
    weighted = LossFunction.of(LossKind.HUBER, 0.3, 5.0, "epsilon")(output, target, torch.tensor([0.1, 1.0]))
    per_image = F.huber_loss(output, target, delta=0.3, reduction="none").mean(dim=(1, 2, 3))
    torch.testing.assert_close(weighted, (per_image * torch.tensor([0.05, 1.0])).mean())


def test_the_defaults_draw_and_score_exactly_as_before():
    """Before the knobs: noise = randn(shape), then the family's sigmas, from one generator; loss = one mse_loss."""
    schedule, shape = EpsSchedule(), torch.Size((2, 4, 8, 8))
    drawn = draw_noise(schedule, shape, torch.Generator().manual_seed(7), TimestepSampling.UNIFORM, 0.0)
    replay = torch.Generator().manual_seed(7)
    assert torch.equal(drawn["noise"], torch.randn(shape, generator=replay))
    assert torch.equal(drawn["sigma"], schedule.sigmas[torch.randint(0, 100, (2,), generator=replay)])
    values = torch.Generator().manual_seed(8)  # not the global generator: earlier tests move it
    clean, answer = torch.randn(shape, generator=values), torch.randn(shape, generator=values)
    loss = denoising_loss(schedule, lambda x, t, c: answer, clean, {}, drawn["noise"], drawn["sigma"],
                          drawn["timestep"])
    # the formula before the knobs: one mse_loss against the schedule's own target (for eps, the noise as
    # recovered from the noisy latent: equal to it up to rounding)
    noisy = schedule.noise_scaling(drawn["sigma"], drawn["noise"], clean)
    target = output_target(schedule, drawn["sigma"], noisy, clean).float()
    assert torch.equal(loss, F.mse_loss(answer, target))
    torch.testing.assert_close(target, drawn["noise"])
    assert TrainSettings().objective_changes() == {}


# --- seeded runs on the pure-torch adapter -----------------------------------------------------------------------

def run(tmp_path: Path, name: str, adapter: TinyAdapter | None = None, steps: int = 6,
        stop_after_steps: int | None = None, **knobs):
    import tiny_assets
    dataset = scan_folder(tiny_assets.build_tiny_dataset(tmp_path / "data", n=4), 64)
    events = []
    reported = lambda: sum(event["kind"] == "step" for event in events)  # noqa: E731
    return train_lora(adapter or TinyAdapter(), dataset, EAGER, LoraSettings(rank=4, alpha=4.0),
                      TrainSettings(steps=steps, learning_rate=1e-3, seed=0, output_name=name, **knobs),
                      tmp_path / "out", lambda **event: events.append(event),
                      lambda: stop_after_steps is not None and reported() >= stop_after_steps)


def metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def _draw_noise_before_the_knobs(model_sampling, shape, generator, *knobs):
    """draw_noise as it was before any knob existed (main at c50e1f8): the noise, then a uniform index into the
    family's table of noise levels, from the run's one generator; every knob argument ignored."""
    noise = torch.randn(shape, generator=generator)
    sigmas = model_sampling.sigmas
    sigma = sigmas.cpu()[torch.randint(0, len(sigmas), (shape[0],), generator=generator)]
    return {"noise": noise, "sigma": sigma, "timestep": model_sampling.timestep(sigma).float()}


def _denoising_loss_before_the_knobs(model_sampling, predict, clean, cond, noise, sigma, timestep, *knobs):
    """denoising_loss as it was before any knob existed: one F.mse_loss against the schedule's own target."""
    noisy = model_sampling.noise_scaling(sigma, noise, clean)
    with torch.no_grad():
        target = output_target(model_sampling, sigma, noisy, clean).float()
    output = predict(model_sampling.calculate_input(sigma, noisy), timestep, cond)
    return F.mse_loss(output.float(), target)


@pytest.fixture(scope="module")
def default_losses(tmp_path_factory) -> list[str]:
    """The losses (float.hex: exact) of a seeded run with every knob at its default, made on this machine: runs
    compared with it differ only by what the test changes, never by the CPU (bf16 autocast rounds the last bits
    differently on other CPUs, so numbers recorded elsewhere are no reference)."""
    defaults = {name: getattr(TrainSettings(), name) for name in (
        "noise_offset", "min_snr_gamma", "timestep_sampling", "timestep_shift", "loss", "huber_c",
        "multires_noise_iterations", "multires_noise_discount")}
    outcome = run(tmp_path_factory.mktemp("defaults"), "defaults", **defaults)
    return [float(loss).hex() for loss in outcome.losses]


def test_a_default_run_trains_bit_for_bit_as_before_the_knobs(tmp_path, default_losses, monkeypatch):
    """The same seeded run with the knobs' code taken out (draw_noise and denoising_loss as before the knobs, in
    this process) trains bit for bit as the run with every knob at its default."""
    import trainer.session
    monkeypatch.setattr(trainer.session, "draw_noise", _draw_noise_before_the_knobs)
    monkeypatch.setattr(trainer.session, "denoising_loss", _denoising_loss_before_the_knobs)
    before = run(tmp_path / "before", "before")
    monkeypatch.undo()
    assert [float(loss).hex() for loss in before.losses] == default_losses
    outcome = run(tmp_path / "absent", "defaults")  # the knobs not passed at all: the same run again
    assert [float(loss).hex() for loss in outcome.losses] == default_losses
    assert "timesteps and loss" not in outcome.report
    meta = metadata(outcome.lora_path)
    assert (meta["ss_noise_offset"], meta["ss_min_snr_gamma"], meta["ss_loss_type"], meta["ss_huber_c"],
            meta["ss_timestep_sampling"]) == ("None", "None", "l2", "None", "uniform")
    assert "ss_discrete_flow_shift" not in meta


@pytest.mark.parametrize("knobs", [
    {"noise_offset": 0.1}, {"min_snr_gamma": 5.0}, {"timestep_sampling": "logit-normal"},
    {"timestep_sampling": "shifted-sigmoid", "timestep_shift": 2.0}, {"loss": "huber", "huber_c": 0.05},
    {"loss": "smooth_l1", "huber_c": 0.05}], ids=lambda knobs: "+".join(knobs))
def test_each_knob_changes_the_seeded_run_and_is_recorded(tmp_path, knobs, default_losses):
    outcome = run(tmp_path, "knob", **knobs)
    assert [float(loss).hex() for loss in outcome.losses] != default_losses
    assert all(math.isfinite(loss) for loss in outcome.losses)
    line = next(line for line in outcome.report.splitlines() if line.startswith("timesteps and loss: "))
    settings = TrainSettings(**knobs)
    assert line == "timesteps and loss: " + ", ".join(f"{k} {v}" for k, v in settings.objective_changes().items())
    meta = metadata(outcome.lora_path)
    expected = {"noise_offset": ("ss_noise_offset", "0.1"), "min_snr_gamma": ("ss_min_snr_gamma", "5.0"),
                "timestep_shift": ("ss_discrete_flow_shift", "2.0"), "huber_c": ("ss_huber_c", "0.05")}
    for knob, (key, value) in expected.items():
        if knob in knobs:
            assert meta[key] == value, key
    sampling = {"logit-normal": "sigmoid", "shifted-sigmoid": "shift"}.get(knobs.get("timestep_sampling"), "uniform")
    assert meta["ss_timestep_sampling"] == sampling
    assert meta["ss_loss_type"] == knobs.get("loss", "l2")
    assert meta["ss_huber_schedule"] == ("constant" if "loss" in knobs else "None")


def test_min_snr_gamma_on_a_flow_model_is_refused_before_any_encoding(tmp_path):
    class FlowAdapter(TinyAdapter):
        def identity(self):
            return FamilyIdentity("TinyFlow", "tiny_flow", "tiny-flow", "pure torch", prediction="flow")

        def encode_image(self, pixels):
            raise AssertionError("encoded before the refusal")
    with pytest.raises(LeanLoRAError, match=r"min_snr_gamma: got 5, but this model is trained by flow matching"):
        run(tmp_path, "flow", FlowAdapter(), min_snr_gamma=5.0)


def test_the_settings_name_the_field_and_take_values():
    for knobs, field in (({"noise_offset": -0.1}, "noise_offset"), ({"noise_offset": 2}, "noise_offset"),
                         ({"min_snr_gamma": -1}, "min_snr_gamma"), ({"min_snr_gamma": float("nan")}, "min_snr_gamma"),
                         ({"timestep_sampling": "sigma"}, "timestep_sampling"), ({"timestep_shift": 0}, "timestep_shift"),
                         ({"loss": "l1"}, "loss"), ({"huber_c": 0}, "huber_c")):
        with pytest.raises(LeanLoRAError, match=rf"^{field}: got "):
            TrainSettings(**knobs)
    settings = TrainSettings(timestep_sampling="uniform", loss="smooth_l1")
    assert settings.timestep_sampling is TimestepSampling.UNIFORM and settings.loss is LossKind.SMOOTH_L1


def test_validation_scores_with_plain_mse_whatever_the_training_loss(tmp_path):
    """TrainingSession.forward_loss (what validation calls) scores a batch with plain MSE on a Huber + min-SNR run;
    the training loss of that same batch differs."""
    from trainer.session import TrainingSession
    from trainer.step.precision import Precision
    adapter = TinyAdapter()
    knobs = TrainSettings(loss="huber", min_snr_gamma=5.0, noise_offset=0.1, timestep_sampling="logit-normal")
    session = TrainingSession(adapter, adapter.training_unet(), [], [], 1, knobs)
    session.precision = Precision("no", adapter.device)
    assert session.loss_function != PLAIN_MSE and session.timestep_sampling is TimestepSampling.LOGIT_NORMAL
    g = torch.Generator().manual_seed(2)
    clean, context = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    draws = draw_noise(adapter.model_sampling, clean.shape, g)
    inputs = {"clean": clean, **draws, "cond.context": context}
    validation = session.forward_loss(inputs)
    with torch.no_grad():
        trained = session.compute_loss(inputs)
        schedule = adapter.model_sampling
        noisy = schedule.noise_scaling(draws["sigma"], draws["noise"], clean)
        predicted = adapter.predict(session.unet, schedule.calculate_input(draws["sigma"], noisy),
                                    draws["timestep"], {"context": context})
    assert torch.equal(validation, F.mse_loss(predicted.float(), draws["noise"]))  # eps: the target is the noise
    assert not torch.allclose(trained, validation)


def test_a_resume_with_other_knob_values_is_reported_as_changed(tmp_path):
    stopped = run(tmp_path, "resumed", steps=6, stop_after_steps=2, noise_offset=0.1, save_every_steps=0)
    assert stopped.partial
    state = state_path(stopped.lora_path)
    resumed = run(tmp_path, "resumed", steps=6, resume_from=state, noise_offset=0.05, loss="huber")
    assert "resume: changed since the state: noise_offset 0.1 -> 0.05, loss l2 -> huber" in resumed.report
    same = run(tmp_path, "resumed", steps=6, resume_from=state, noise_offset=0.1)
    assert "changed since the state" not in same.report


@pytest.mark.comfy
def test_the_train_node_trains_with_the_knobs_and_the_lora_file_records_them(comfy_server):
    from comfy_headless import execution_error
    from test_node_ux import train_only_prompt
    info = comfy_server.object_info()["LeanLoRATrain"]["input"]["optional"]
    knobs = ["noise_offset", "min_snr_gamma", "timestep_sampling", "timestep_shift", "loss", "huber_c"]
    names = list(info)
    start = names.index("noise_offset")
    # after every input saved UI workflows have (their widget positions still load), followed only by later knobs
    assert names[start:start + 6] == knobs and names[start - 1] == "validation_every_n_steps"
    assert all(info[name][1].get("advanced") for name in knobs)
    assert info["timestep_sampling"][0] == ["family default", "uniform", "logit-normal", "shifted sigmoid"]
    prompt = train_only_prompt(steps=3, output_name="knobs_node", noise_offset=0.1, min_snr_gamma=5.0,
                               timestep_sampling="shifted sigmoid", timestep_shift=2.0, loss="Huber", huber_c=0.05)
    entry = comfy_server.run(prompt, timeout=300)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    report = entry["outputs"]["5"]["text"][0]
    assert ("timesteps and loss: noise_offset 0.1, min_snr_gamma 5, timestep_sampling shifted-sigmoid, "
            "timestep_shift 2, loss huber, huber_c 0.05") in report
    meta = metadata(comfy_server.base_dir / "models" / "loras" / "knobs_node.safetensors")
    assert {key: meta[key] for key in ("ss_noise_offset", "ss_min_snr_gamma", "ss_timestep_sampling",
                                       "ss_discrete_flow_shift", "ss_loss_type", "ss_huber_schedule", "ss_huber_c")} \
        == {"ss_noise_offset": "0.1", "ss_min_snr_gamma": "5.0", "ss_timestep_sampling": "shift",
            "ss_discrete_flow_shift": "2.0", "ss_loss_type": "huber", "ss_huber_schedule": "constant",
            "ss_huber_c": "0.05"}


@pytest.mark.comfy
def test_a_saved_train_node_loads_its_values_with_the_knobs_at_their_defaults_and_hidden(comfy_server, tiny_assets):
    """The template's Train node was saved before the knobs existed: in ComfyUI's own frontend each saved value
    lands in its widget, the knobs take their defaults, and they show only with Show Advanced."""
    import json
    import browser_ui
    if browser_ui.missing() is not None:
        pytest.skip(str(browser_ui.missing()))
    template = next(t for t in browser_ui.TEMPLATES if t.stem == "leanlora_train_then_generate")
    saved = next(n for n in json.loads(template.read_text())["nodes"] if n["type"] == "LeanLoRATrain")
    with browser_ui.browser_page(comfy_server.url) as page:
        page.load_template(template.stem)
        node = page.evaluate("""() => { const n = app.graph._nodes.find(n => n.type === 'LeanLoRATrain');
            const inputs = n.widgets.filter(w => w.serialize !== false);
            const shown = () => n.widgets.filter(w => n.isWidgetVisible(w)).map(w => w.name);
            const before = shown();
            n.showAdvanced = true;
            // a node saved with every input of the version before the knobs (validation_every_n_steps last, 7)
            const start = inputs.findIndex(w => w.name === 'noise_offset');
            const full = inputs.slice(0, start).map(w => w.value);
            full[full.length - 1] = 7;
            const m = LiteGraph.createNode('LeanLoRATrain');
            m.configure({id: 998, type: m.type, pos: [0, 0], size: [400, 600], flags: {}, order: 0, mode: 0,
                         inputs: [], outputs: [], properties: {}, widgets_values: full});
            const loaded = m.widgets.filter(w => w.serialize !== false).map(w => w.value);
            return {names: inputs.map(w => w.name), values: inputs.map(w => w.value), shown: before,
                    advanced: shown(), full: full, loaded: loaded, start: start}; }""")
    knobs = ["noise_offset", "min_snr_gamma", "timestep_sampling", "timestep_shift", "loss", "huber_c"]
    old = saved["widgets_values"]
    start = node["start"]  # the knobs, then only later options (tests/test_training_options.py checks theirs)
    defaults = [0.0, 0.0, "family default", 3.0, "MSE", 0.1]
    assert node["names"][start:start + 6] == knobs and len(node["values"]) > len(old)
    assert node["values"][:len(old)] == old
    assert node["values"][start:start + 6] == defaults
    assert not set(knobs) & set(node["shown"]) and set(knobs) <= set(node["advanced"])
    assert node["loaded"][:start + 6] == node["full"] + defaults


def test_comfyuis_eps_v_and_flow_models_get_their_own_min_snr_weighting(comfy_objects):
    """The prediction min-SNR weights by comes from the MODEL's own model_sampling (ComfyUI's classes): eps and
    v_prediction (ModelSamplingDiscrete's patch) weight differently, a flow schedule (ModelSamplingSD3) is refused."""
    from comfy_extras.nodes_model_advanced import ModelSamplingDiscrete, ModelSamplingSD3
    from bridge.comfy_adapter import ComfyAdapter
    model, clip, vae = comfy_objects
    g = torch.Generator().manual_seed(0)
    output, target = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    sigma = torch.tensor([0.5, 7.0])
    weighted = {}
    for patch in ("eps", "v_prediction"):
        adapter = ComfyAdapter(ModelSamplingDiscrete().patch(model, patch, False)[0], clip, vae)
        loss = LossFunction.of(LossKind.MSE, 0.1, 5.0, adapter.identity().prediction)
        weights = min_snr_weights(sigma, 5.0, patch == "v_prediction")
        per_image = ((output - target) ** 2).mean(dim=(1, 2, 3))
        weighted[patch] = loss(output, target, sigma)
        torch.testing.assert_close(weighted[patch], (per_image * weights).mean())
    assert not torch.allclose(weighted["eps"], weighted["v_prediction"])
    flow = ComfyAdapter(ModelSamplingSD3().patch(model, 3.0)[0], clip, vae)
    with pytest.raises(LeanLoRAError, match="min_snr_gamma: got 5, but this model is trained by flow matching"):
        LossFunction.of(LossKind.MSE, 0.1, 5.0, flow.identity().prediction)
