# Vendored verbatim from https://github.com/pytorch/examples/blob/77f55b9/fast_neural_style/neural_style/utils.py
# Copyright (c) 2017, Pytorch contributors. BSD 3-Clause License (see LICENSE beside this file).
# Only the tensor helpers are kept: gram_matrix and normalize_batch (lines 21-34), unedited; the PIL
# image load/save helpers and their PIL import are cut (whole statements).
import torch


def gram_matrix(y):
    (b, ch, h, w) = y.size()
    features = y.view(b, ch, w * h)
    features_t = features.transpose(1, 2)
    gram = features.bmm(features_t) / (ch * h * w)
    return gram


def normalize_batch(batch):
    # normalize using imagenet mean and std
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    batch = batch.div_(255.0)
    return (batch - mean) / std
