"""A fork: an image classifier on float images [3, H, W] with a fresh random crop and flip at every step.

    python train.py --config configs/image_classifier.toml
    python -m pytest tests/conformance --fork-config configs/image_classifier.toml

One file, no edit elsewhere: the data source and the model register themselves below, and the config names
them by import path (`data.source = "forks.image_classifier:synthetic-images"`,
`model.name = "forks.image_classifier:small-cnn"`). The loss is the default cross-entropy, which takes logits
[rows, classes] and labels [rows] (-100 on the padding rows the loop adds).

The images are synthetic, so the fork runs anywhere: each class is an oriented stripe pattern of its own
frequency, with a random phase, colour and noise per image, all drawn from run.seed. The augmentation (a crop
of the image padded by CROP_PADDING pixels, then a horizontal flip half of the time) is a pure function of
(seed, step, row id), drawn with step_uniforms, never from a global generator: every rank, the checker and a
resumed run rebuild the same pixels (docs/forking.md, "Data that changes with the step"). Validation reads the
rows at VALIDATION_STEP, where they are not augmented.

The model normalises with GroupNorm, which reads one example at a time. BatchNorm would not: in train mode it
normalises each example by the statistics of the micro-batch it happens to share, so its gradient depends on m
and on D, and no accumulation can reproduce the full batch's (docs/forking.md, "What no loop can make exact").
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from accumulation.config.config_keys import setting
from accumulation.config.registry import register_data, register_model
from accumulation.data.custom import data_from_custom_rows, tensor_fingerprint
from accumulation.data.rows import DataError, RawExample
from accumulation.data.sources import VALIDATION_STEP
from accumulation.data.splits import Data
from accumulation.data.uniforms import step_uniforms

CROP_PADDING = 2  # pixels of zeros around the image before a crop of its own size


@dataclass(frozen=True)
class ImageSettings:
    images: int = setting(640, "synthetic images in all, split by data.val_fraction", "images", at_least=2)
    image_size: int = setting(16, "height and width of each image", "pixels", at_least=4, at_most=256)
    classes: int = setting(4, "classes: the labels 0..classes - 1", "classes", at_least=2, at_most=64)
    augment: bool = setting(True, "a fresh random crop and horizontal flip of every training image at every step")


def synthetic_images(count: int, size: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [count, 3, size, size] images and int64 [count] labels: class c is a stripe pattern of frequency
    c + 1 along a direction of its own, with a random phase, colour and noise."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (count,), generator=generator)
    coordinates = torch.arange(size, dtype=torch.float32) / size
    y, x = torch.meshgrid(coordinates, coordinates, indexing="ij")
    angle = labels.float() * math.pi / classes  # [count]
    along = x * torch.cos(angle)[:, None, None] + y * torch.sin(angle)[:, None, None]
    phase = torch.rand(count, generator=generator)[:, None, None] * 2 * math.pi
    stripes = torch.sin(2 * math.pi * (labels.float() + 1)[:, None, None] * along + phase)
    colour = torch.rand(count, 3, generator=generator)[:, :, None, None] + 0.5
    noise = 0.3 * torch.randn(count, 3, size, size, generator=generator)
    return stripes[:, None] * colour + noise, labels


class ImageRows:
    """The Rows interface (accumulation/data/rows.py) over images held in memory: one labelled image per row."""

    seq_len = None  # rows are images, not sequences: data.seq_len does not apply

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, seed: int, augment: bool):
        self.images, self.labels, self.seed, self.augment = images, labels, seed, augment

    @property
    def num_rows(self) -> int:
        return len(self.labels)

    def image(self, row_id: int, step: int) -> torch.Tensor:
        """Row `row_id` as step `step` sees it: cropped from the padded image at an offset, and flipped, both
        drawn from (seed, step, row id); as stored at VALIDATION_STEP or without augmentation."""
        image = self.images[row_id]
        if not self.augment or step == VALIDATION_STEP:
            return image
        size = image.shape[-1]
        across, down, flip = step_uniforms(self.seed, step, torch.tensor([row_id]), 3)[0]
        offsets = 2 * CROP_PADDING + 1  # crop offsets 0..2·CROP_PADDING in each direction
        left, top = int(across * offsets), int(down * offsets)
        padded = nn.functional.pad(image, (CROP_PADDING,) * 4)
        cropped = padded[:, top : top + size, left : left + size]
        return cropped.flip(-1) if flip < 0.5 else cropped

    def examples(self, row_ids: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        images = [self.image(int(row_id), step) for row_id in row_ids]
        stacked = torch.stack(images) if images else self.images[:0]
        return stacked, self.labels[row_ids]

    def supervised_counts(self, row_ids: torch.Tensor, step: int) -> torch.Tensor:
        return torch.ones(len(row_ids), dtype=torch.int64)  # every image has its label

    def raw_example(self, row_id: int, step: int) -> RawExample:
        return RawExample(inputs=self.image(int(row_id), step), label=int(self.labels[row_id]))


def build_images(data_config, *, model_vocab_size: int, seed: int) -> Data:
    settings = data_config.own
    images, labels = synthetic_images(settings.images, settings.image_size, settings.classes, seed)
    held_out = math.ceil(settings.images * data_config.val_fraction)
    if held_out >= settings.images:
        raise DataError(f"data.val_fraction: {data_config.val_fraction} leaves no training image; lower it")
    train = ImageRows(images[held_out:], labels[held_out:], seed, settings.augment)
    val = ImageRows(images[:held_out], labels[:held_out], seed, augment=False) if held_out else None
    fingerprint = tensor_fingerprint(train.images, train.labels, settings.augment)
    format = f"synthetic images 3x{settings.image_size}x{settings.image_size}, {settings.classes} classes"
    format += ", random crop and flip every step" if settings.augment else ""
    return data_from_custom_rows(
        data_config.source, train, val, fingerprint=fingerprint, vocab_size=settings.classes, format=format
    )


class SmallCNN(nn.Module):
    """model.n_layer blocks of (3x3 convolution, GroupNorm, ReLU), each after the first halving the resolution,
    model.d_model channels, then the mean over the pixels and a linear layer to one logit per class."""

    def __init__(self, channels: int, blocks: int, classes: int, seed: int):
        super().__init__()
        layers, width_in = [], 3
        for block in range(blocks):
            stride = 1 if block == 0 else 2
            layers += [nn.Conv2d(width_in, channels, 3, stride=stride, padding=1), nn.GroupNorm(4, channels), nn.ReLU()]
            width_in = channels
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)
        self.initialise(seed)

    @torch.no_grad()
    def initialise(self, seed: int) -> None:
        """He initialisation of every weight from a generator seeded with run.seed; zero biases, unit norms."""
        generator = torch.Generator().manual_seed(seed)
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
            elif parameter.dim() == 1:  # GroupNorm's gain
                parameter.fill_(1.0)
            else:
                fan_in = parameter[0].numel()
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * math.sqrt(2 / fan_in))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean(dim=(2, 3)))  # logits [rows, classes]

    def describe(self) -> str:
        parameters = sum(parameter.numel() for parameter in self.parameters())
        return (
            f"small-cnn: {parameters:,} parameters ({len(self.features) // 3} blocks, {self.head.in_features} channels)"
        )


def check_group_norm_width(config) -> None:
    if config.model.d_model % 4 != 0:
        raise ValueError(f"model.d_model: expected a multiple of 4 (GroupNorm's 4 groups), got {config.model.d_model}")


def build_cnn(model_config, vocab_size: int, *, seq_len: int, seed: int) -> SmallCNN:
    """vocab_size is the number of classes (the data's, unless model.vocab_size asks for more)."""
    return SmallCNN(model_config.d_model, model_config.n_layer, vocab_size, seed)


register_data("synthetic-images", build_images, settings=ImageSettings)
register_model("small-cnn", build_cnn, check=check_group_norm_width)
