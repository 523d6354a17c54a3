"""Training the shipped shapes models on this machine's CPUs, deterministically by seed.

Order (each stage reads what the earlier ones made): the dataset is rendered once; the VAE
learns to reconstruct it; its latents are computed once (the MMDiT's stage encodes its own); the
text encoder and UNet learn to denoise them (v-prediction on SD1.5's noise schedule, 10% empty
captions so classifier-free guidance works); the ControlNet learns the silhouette with the UNet frozen; the LoRA learns the
outlined style with the UNet frozen; an SD3-architecture MMDiT and SD3's three text encoders
learn to denoise the same latents by flow matching; the judge learns shape and colour from the
renders.

Every stage logs its loss per step; `ShapesTraining.logs` keeps them, and the first ones are
written beside the weights so a test can check that training from the same seed reproduces them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL, ControlNetModel, DDPMScheduler, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
    StableDiffusion3Pipeline, UNet2DConditionModel,
)
from torch import nn
from tqdm import tqdm
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from stepserve.engine.addons.lora import LoraLayer, LoraWeights
from stepserve.engine.families.presets import autoencoder_kl, clip_text_config, t5_encoder
from stepserve.engine.families.sd15 import SD_SCHEDULER
from stepserve.engine.shapes import dataset
from stepserve.engine.shapes.judge import Judge, judge_targets, pixels
from stepserve.engine.tokenizer import word_clip_tokenizer, word_t5_tokenizer

TOKENS = 32  # the text encoder's context: the longest caption is 14 tokens with its markers
T5_TOKENS = 16  # the SD3 model's T5 context: the longest caption is 12 pieces with its end
# The SD3 model's sampling schedule: flow matching, unshifted (SD3 shifts by 3 at 1024 px, where
# far more tokens carry each shape than in an 8x8 latent).
SD3_SHAPES_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0)
CAPTION_DROPOUT = 0.1  # empty captions, so the unconditional prediction is learned too
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out")


@dataclass(frozen=True)
class Sizes:
    """The architectures: the real classes at small widths."""

    text: dict = field(default_factory=lambda: dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                    num_attention_heads=4))
    unet: dict = field(default_factory=lambda: dict(
        sample_size=8, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=16, use_linear_projection=True,
        # The caption also pooled into the timestep embedding (as DeepFloyd IF's UNet does), so every
        # ResNet block sees it, not only the cross-attention layers: colours come in fewer steps.
        addition_embed_type="text", addition_embed_type_num_heads=4))
    # 16 latent channels (as SD3's VAE): with 4, a VAE this small and this briefly trained blurs the
    # shapes' edges past what the judge can tell apart.
    vae: dict = field(default_factory=lambda: dict(block_out_channels=(16, 32, 64, 64), layers_per_block=1,
                                                   norm_num_groups=8, sample_size=64, latent_channels=16))
    controlnet_embedding: tuple[int, ...] = (8, 16, 32, 32)
    lora_rank: int = 8
    # SD3's three text encoders: CLIP-L and CLIP-G as two small CLIPs, T5 as wide as both
    # together (the pipeline zero-pads their states to its width).
    sd3_clip: dict = field(default_factory=lambda: dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                        num_attention_heads=4, projection_dim=32))
    sd3_t5: dict = field(default_factory=lambda: dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                                      relative_attention_num_buckets=8,
                                                      relative_attention_max_distance=16))
    # Its positional table covers 32 patches a side: 512 px, the served max_size.
    dit: dict = field(default_factory=lambda: dict(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=4, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=128, pooled_projection_dim=64,
        pos_embed_max_size=32))


@dataclass(frozen=True)
class Schedule:
    """How long each stage trains (optimizer steps), its batch and learning rate."""

    samples: int = 12_000
    vae_steps: int = 3500
    vae_batch: int = 16
    vae_crop: int = 32  # the VAE trains on crops (it is convolutional): 4x cheaper than whole pictures
    vae_lr: float = 2e-3
    unet_steps: int = 4000
    # 64, not 32: twice the pictures a step for 1.5x its time. At 4000 steps it drew 88% of the
    # held-out prompts right at CFG 5 (and 98% at 2.5) where 32 drew 69.5% (and 74% at 3).
    unet_batch: int = 64
    unet_lr: float = 2e-3
    # The UNet's training timesteps: logit-normal over the 1000 (SD3's sampling, on DDPM's index):
    # most of the batch at mid noise, where the caption decides the shape, few at the ends, where
    # the loss says little about it. Drew more prompts right than uniform timesteps at equal steps.
    unet_timestep_spread: float = 1.0
    unet_ema: float = 0.998  # the shipped text encoder and UNet are this moving average of the trained ones
    # What the UNet predicts (the scheduler config says so to every sampler). With epsilon, the
    # loss barely depends on the caption at high noise, and the UNet learned to ignore it.
    prediction_type: str = "v_prediction"
    addon_batch: int = 32  # the ControlNet's and the LoRA's batch
    controlnet_steps: int = 500
    controlnet_lr: float = 1e-3
    lora_steps: int = 400
    lora_lr: float = 2e-3
    judge_steps: int = 800
    judge_lr: float = 2e-3
    dit_steps: int = 2000
    dit_batch: int = 64
    dit_lr: float = 3e-3  # with the text encoders frozen it drew more prompts right than 1e-3 or 2e-3
    dit_sigma_spread: float = 1.0  # logit-normal sigmas, SD3's training distribution
    dit_ema: float = 0.998


class Log:
    """A stage's losses, with a progress bar."""

    def __init__(self, name: str, steps: int, show: bool):
        self.losses: list[float] = []
        self.bar = tqdm(total=steps, desc=name, disable=not show, leave=True)

    def add(self, loss: float) -> None:
        self.losses.append(loss)
        self.bar.update(1)
        if len(self.losses) % 25 == 0:
            self.bar.set_postfix(loss=f"{np.mean(self.losses[-25:]):.4f}")

    def close(self) -> None:
        self.bar.close()


def caption_words() -> list[str]:
    words = {"a", "an", "on", "background", ",", *dataset.SHAPES, *dataset.COLOURS, *dataset.SIZES}
    for position in dataset.POSITIONS:
        words.update(position.split())
    return sorted(words)


def _fit(params: Iterable[nn.Parameter], loss: Callable[[int], torch.Tensor], steps: int, lr: float,
         log: Log, after_step: Callable[[], None] | None = None, stop_after: int | None = None) -> None:
    """AdamW with a short warm-up and a cosine decay over `steps`; `loss(step)` draws its own
    batch. `stop_after` ends it early, on the same learning rates."""
    params = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    for step in range(steps if stop_after is None else min(steps, stop_after)):
        value = loss(step)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if after_step is not None:
            after_step()
        log.add(value.item())
    log.close()


def _fit_averaged(modules: nn.ModuleList, loss: Callable[[int], torch.Tensor], steps: int, lr: float, ema: float,
                  log: Log, stop_after: int | None) -> nn.ModuleList:
    """`_fit` of `modules`, returning their exponential moving average (decay `ema`) over the
    steps, which is what ships."""
    average = torch.optim.swa_utils.AveragedModel(modules, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(ema))
    _fit(modules.parameters(), loss, steps, lr, log, after_step=lambda: average.update_parameters(modules),
         stop_after=stop_after)
    return average.module


class Latents:
    """A style's pictures as scaled VAE latents (posterior means), encoded the first time asked for."""

    def __init__(self, vae: AutoencoderKL, renders: dataset.Renders):
        self.vae, self.renders = vae, renders
        channels, factor = vae.config.latent_channels, 2 ** (len(vae.config.block_out_channels) - 1)
        self.cache = torch.zeros(len(renders), channels, renders.size // factor, renders.size // factor)
        self.done = torch.zeros(len(renders), dtype=torch.bool)

    @torch.no_grad()
    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        missing = idx[~self.done[idx]].unique()
        if len(missing):
            means = self.vae.encode(pixels(self.renders.pictures(missing.numpy()))).latent_dist.mean
            self.cache[missing] = means * self.vae.config.scaling_factor
            self.done[missing] = True
        return self.cache[idx]


class ShapesTraining:
    """One training run. `stop_after` (steps per stage) cuts every stage short: what the
    reproducibility test uses."""

    def __init__(self, seed: int = 0, sizes: Sizes = Sizes(), schedule: Schedule = Schedule(),
                 stop_after: int | None = None, show: bool = True):
        self.seed, self.sizes, self.schedule = seed, sizes, schedule
        self.stop_after, self.show = stop_after, show
        self.logs: dict[str, list[float]] = {}
        self.tokenizer = word_clip_tokenizer(caption_words(), TOKENS)
        self.filled = dataset.Renders(seed, schedule.samples)
        self.outlined = dataset.Renders(seed, schedule.samples, style="outlined")  # the same scenes
        self.captions = [s.caption for s in self.filled.scenes]
        # SD1.5's training noise schedule (sampling steps it with Euler, `sd15.SD_SCHEDULER`).
        self.noise_schedule = DDPMScheduler(**{k: v for k, v in SD_SCHEDULER.items() if k != "timestep_spacing"})

    # -- plumbing ---------------------------------------------------------------------------
    def _log(self, name: str, steps: int) -> Log:
        log = Log(name, steps if self.stop_after is None else min(steps, self.stop_after), self.show)
        self.logs[name] = log.losses
        return log

    def _generator(self, stage: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 7919 + stage)

    def _seed_module(self, stage: int) -> None:
        torch.manual_seed(self.seed * 7919 + 100 + stage)

    def token_ids(self, captions: list[str]) -> torch.Tensor:
        return self.tokenizer(captions, padding="max_length", max_length=TOKENS, truncation=True,
                              return_tensors="pt").input_ids

    # -- stages -----------------------------------------------------------------------------
    def train_vae(self) -> AutoencoderKL:
        s = self.schedule
        self._seed_module(0)
        vae = autoencoder_kl(self.sizes.vae)
        g = self._generator(0)
        side = self.filled.size

        def loss(step: int) -> torch.Tensor:
            idx = torch.randint(0, len(self.filled), (s.vae_batch,), generator=g)
            y, x = torch.randint(0, side - s.vae_crop + 1, (2,), generator=g).tolist()
            y, x = y // 8 * 8, x // 8 * 8  # crops on the latent grid, as whole pictures are seen
            batch = pixels(self.filled.pictures(idx.numpy()))[:, :, y:y + s.vae_crop, x:x + s.vae_crop]
            posterior = vae.encode(batch).latent_dist
            z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=g)
            reconstruction = vae.decode(z).sample
            # L1 beside MSE: flat colours converge faster with it; the KL term only keeps the posterior tame.
            return F.l1_loss(reconstruction, batch) + F.mse_loss(reconstruction, batch) + 1e-6 * posterior.kl().mean()

        _fit(vae.parameters(), loss, s.vae_steps, s.vae_lr, self._log("vae", s.vae_steps),
             stop_after=self.stop_after)
        vae.eval().requires_grad_(False)
        with torch.no_grad():  # SD's convention: latents scaled to unit variance (over the first samples)
            means = vae.encode(pixels(self.filled.pictures(np.arange(min(1024, len(self.filled)))))).latent_dist.mean
        vae.register_to_config(scaling_factor=float(1 / means.std()), shift_factor=0.0)
        self.use_vae(vae)
        return vae

    def use_vae(self, vae: AutoencoderKL) -> None:
        """Later stages train on this VAE's latents (a trained one, or the shipped one)."""
        self.latents = {"filled": Latents(vae, self.filled), "outlined": Latents(vae, self.outlined)}

    def use_text_unet(self, text: CLIPTextModel, unet: UNet2DConditionModel) -> None:
        """The ControlNet and the LoRA train on this (frozen) text encoder and UNet."""
        self.text, self.unet = text.eval().requires_grad_(False), unet.eval().requires_grad_(False)

    def train_text_unet(self) -> tuple[CLIPTextModel, UNet2DConditionModel]:
        s = self.schedule
        self._seed_module(1)
        text = CLIPTextModel(CLIPTextConfig(vocab_size=len(self.tokenizer.get_vocab()), max_position_embeddings=TOKENS,
                                            bos_token_id=0, eos_token_id=1, pad_token_id=1, **self.sizes.text))
        channels = self.sizes.vae.get("latent_channels", 4)
        unet = UNet2DConditionModel(in_channels=channels, out_channels=channels, **self.sizes.unet)
        noise_schedule = self.noise_schedule
        g = self._generator(1)
        ids = self.token_ids(self.captions)
        empty = self.token_ids([""])[0]

        def loss(step: int) -> torch.Tensor:
            idx = torch.randint(0, len(ids), (s.unet_batch,), generator=g)
            batch_ids = ids[idx].clone()
            batch_ids[torch.rand(s.unet_batch, generator=g) < CAPTION_DROPOUT] = empty
            latents = self.latents["filled"](idx)
            noise = torch.randn(latents.shape, generator=g)
            u = torch.sigmoid(torch.randn(s.unet_batch, generator=g) * s.unet_timestep_spread)
            t = (u * (noise_schedule.config.num_train_timesteps - 1)).round().long()
            noisy = noise_schedule.add_noise(latents, noise, t)
            context = text(batch_ids)[0]
            target = self._target(latents, noise, t)
            # Every timestep weighs alike in v-space: Min-SNR-5 weighting, which takes weight off
            # the noisy steps where the shape is decided, drew fewer prompts right at equal steps.
            return F.mse_loss(unet(noisy, t, context).sample, target)

        modules = nn.ModuleList([text, unet])
        text, unet = _fit_averaged(modules, loss, s.unet_steps, s.unet_lr, s.unet_ema, self._log("unet", s.unet_steps),
                                   self.stop_after)
        self.use_text_unet(text, unet)
        return text, unet

    def _denoising_loss(self, g: torch.Generator, latents: torch.Tensor,
                        forward: Callable[..., torch.Tensor], ids: torch.Tensor,
                        idx: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(latents.shape, generator=g)
        t = torch.randint(0, self.noise_schedule.config.num_train_timesteps, (len(latents),), generator=g)
        noisy = self.noise_schedule.add_noise(latents, noise, t)
        with torch.no_grad():
            context = self.text(ids)[0]
        return F.mse_loss(forward(noisy, t, context, idx), self._target(latents, noise, t))

    def _target(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.schedule.prediction_type == "v_prediction":
            return self.noise_schedule.get_velocity(latents, noise, t)
        return noise

    def train_controlnet(self) -> ControlNetModel:
        s = self.schedule
        self._seed_module(2)
        controlnet = ControlNetModel.from_unet(
            self.unet, conditioning_embedding_out_channels=self.sizes.controlnet_embedding)
        controlnet.train().requires_grad_(True)
        g = self._generator(2)
        ids = self.token_ids(self.captions)

        def forward(noisy, t, context, idx):
            # The control image as the pipeline feeds it: RGB in [0, 1].
            control = torch.from_numpy(self.filled.silhouettes(idx.numpy())).permute(0, 3, 1, 2).float() / 255
            down, mid = controlnet(noisy, t, context, controlnet_cond=control, return_dict=False)
            return self.unet(noisy, t, context, down_block_additional_residuals=down,
                             mid_block_additional_residual=mid).sample

        def loss(step: int) -> torch.Tensor:
            idx = torch.randint(0, len(ids), (s.addon_batch,), generator=g)
            return self._denoising_loss(g, self.latents["filled"](idx), forward, ids[idx], idx)

        _fit(controlnet.parameters(), loss, s.controlnet_steps, s.controlnet_lr,
             self._log("controlnet", s.controlnet_steps), stop_after=self.stop_after)
        return controlnet.eval().requires_grad_(False)

    def train_lora(self) -> LoraWeights:
        """A rank-r LoRA over the UNet's attention layers that draws shapes outlined, not filled."""
        s, rank = self.schedule, self.sizes.lora_rank
        self._seed_module(3)
        layers = {name: m for name, m in self.unet.named_modules()
                  if isinstance(m, (nn.Linear, nn.Conv2d)) and name.endswith(LORA_TARGETS)}
        down = nn.ParameterDict({k.replace(".", "|"): nn.Parameter(
            torch.randn(rank, m.weight.shape[1], *m.weight.shape[2:]) / m.weight.shape[1] ** 0.5)
            for k, m in layers.items()})
        up = nn.ParameterDict({k.replace(".", "|"): nn.Parameter(torch.zeros(m.weight.shape[0], rank, *(
            (1, 1) if m.weight.dim() == 4 else ()))) for k, m in layers.items()})
        hooks = []
        for name, module in layers.items():
            key = name.replace(".", "|")

            def hook(mod, inputs, output, key=key):
                x = inputs[0]
                if isinstance(mod, nn.Conv2d):
                    return output + F.conv2d(F.conv2d(x, down[key]), up[key])
                return output + F.linear(F.linear(x, down[key]), up[key])
            hooks.append(module.register_forward_hook(hook))
        g = self._generator(3)
        ids = self.token_ids(self.captions)

        def loss(step: int) -> torch.Tensor:
            idx = torch.randint(0, len(ids), (s.addon_batch,), generator=g)
            return self._denoising_loss(g, self.latents["outlined"](idx),
                                        lambda noisy, t, context, _: self.unet(noisy, t, context).sample, ids[idx], idx)

        try:
            _fit([*down.values(), *up.values()], loss, s.lora_steps, s.lora_lr,
                 self._log("lora", s.lora_steps), stop_after=self.stop_after)
        finally:
            for h in hooks:
                h.remove()
        return LoraWeights("outlined", {name: LoraLayer(down[name.replace(".", "|")].detach().clone(),
                                                        up[name.replace(".", "|")].detach().clone(), 1.0)
                                        for name in layers})

    def sd3_components(self) -> dict:
        """SD3's tokenizers and text encoders for the shapes captions, at their seeded initial weights."""
        self._seed_module(5)
        words = caption_words()
        clip = word_clip_tokenizer(words, TOKENS)
        t5 = word_t5_tokenizer(words, T5_TOKENS)
        config = clip_text_config(dict(vocab_size=len(clip.get_vocab()), **self.sizes.sd3_clip))
        t5_config = dict(vocab_size=len(t5.get_vocab()), **self.sizes.sd3_t5)
        return dict(tokenizer=clip, text_encoder=CLIPTextModelWithProjection(config),
                    tokenizer_2=clip, text_encoder_2=CLIPTextModelWithProjection(config),
                    tokenizer_3=t5, text_encoder_3=t5_encoder(t5_config))

    def train_dit(self, vae: AutoencoderKL) -> StableDiffusion3Pipeline:
        """An SD3Transformer2DModel and SD3's three text encoders trained together to denoise the
        filled pictures' latents by flow matching (the velocity, noise minus picture, at
        logit-normal sigmas), 10% of captions empty; the captions encoded by the pipeline's own
        `encode_prompt`, as served. Returns the pipeline, its modules an EMA of the trained ones."""
        s = self.schedule
        encoders = self.sd3_components()
        self._seed_module(6)
        dit = SD3Transformer2DModel(**self.sizes.dit)
        pipe = StableDiffusion3Pipeline(transformer=dit, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(
            **SD3_SHAPES_SCHEDULER), **encoders)
        # Trained, not frozen: left at random weights they passed on which colour is the shape's and
        # which the background's too faintly (29.5% of prompts drawn right, the colours often swapped).
        modules = nn.ModuleList([dit, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]).train()
        g = self._generator(5)
        # Its own latents, encoded in its own batches: how the VAE batches them moves them at float
        # rounding, which training amplifies, so this stage trains alike whether or not the UNet's
        # stage ran before it in the same process.
        filled = Latents(vae, self.filled)

        def loss(step: int) -> torch.Tensor:
            idx = torch.randint(0, len(self.captions), (s.dit_batch,), generator=g)
            empty = (torch.rand(s.dit_batch, generator=g) < CAPTION_DROPOUT).tolist()
            captions = ["" if e else self.captions[i] for i, e in zip(idx.tolist(), empty)]
            context, _, pooled, _ = pipe.encode_prompt(captions, None, None, do_classifier_free_guidance=False,
                                                       max_sequence_length=T5_TOKENS)
            latents = filled(idx)
            noise = torch.randn(latents.shape, generator=g)
            sigma = torch.sigmoid(torch.randn(s.dit_batch, generator=g) * s.dit_sigma_spread)
            noisy = (1 - sigma[:, None, None, None]) * latents + sigma[:, None, None, None] * noise
            velocity = dit(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=context,
                           pooled_projections=pooled, return_dict=False)[0]
            return F.mse_loss(velocity, noise - latents)

        averaged = _fit_averaged(modules, loss, s.dit_steps, s.dit_lr, s.dit_ema, self._log("dit", s.dit_steps),
                                 self.stop_after)
        trained = [m.eval().requires_grad_(False) for m in averaged]
        pipe.transformer, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3 = trained
        return pipe

    def train_judge(self) -> Judge:
        s = self.schedule
        self._seed_module(4)
        judge = Judge()
        g = self._generator(4)
        shape, colour = judge_targets(self.filled.scenes)

        def loss(step: int) -> torch.Tensor:
            idx = torch.randint(0, len(self.filled), (64,), generator=g)
            shape_logits, colour_logits = judge(pixels(self.filled.pictures(idx.numpy())))
            return F.cross_entropy(shape_logits, shape[idx]) + F.cross_entropy(colour_logits, colour[idx])

        judge.train()
        _fit(judge.parameters(), loss, s.judge_steps, s.judge_lr, self._log("judge", s.judge_steps),
             stop_after=self.stop_after)
        return judge.eval().requires_grad_(False)
