"""facebookresearch/detr: DETR set-prediction training with Hungarian matching. The criterion is
restated whole: ``HungarianMatcher`` (models/matcher.py; under ``@torch.no_grad()``: softmax class
probabilities, ``cost_class = -out_prob[:, tgt_ids]``, ``torch.cdist(p=1)`` box cost, ``-generalized_box_iou``
cost, ``C = ...; C.view(bs, num_queries, -1).cpu()``, ``scipy.optimize.linear_sum_assignment`` on each
``C.split(sizes, -1)`` block, the indices back as ``torch.as_tensor(int64)``) and ``SetCriterion``
(models/detr.py: ``empty_weight`` buffer with ``eos_coef`` for the no-object class, ``loss_labels``
-- ``target_classes`` filled with ``num_classes``, the matched entries written by advanced
indexing, weighted ``cross_entropy``, ``class_error`` from ``accuracy`` --, ``loss_cardinality``
under no_grad, ``loss_boxes`` -- L1 and ``1 - diag(generalized_box_iou)`` over ``num_boxes`` --,
``num_boxes`` through ``torch.clamp(... / get_world_size(), min=1).item()``, and the auxiliary
losses: the matcher run again for every intermediate decoder output, keys suffixed ``_{i}``);
util/box_ops.py's ``box_cxcywh_to_xyxy``, ``box_iou`` and ``generalized_box_iou`` (with its
``assert (boxes[:, 2:] >= boxes[:, :2]).all()``); util/misc.py's ``accuracy``, ``reduce_dict``
(world size 1: the dict itself), ``SmoothedValue`` and ``MetricLogger.update`` (``v.item()`` of
every tensor). ``build``'s ``weight_dict`` with the aux copies, ``losses = ['labels', 'boxes',
'cardinality']``; main.py's AdamW on two param dicts (the backbone at ``lr_backbone``),
``weight_decay``, ``StepLR(optimizer, lr_drop)`` stepped per epoch, ``clip_max_norm``.

Loop: engine.py ``train_one_epoch``; its per-batch body is the step function
``train_batch(samples, targets)``: ``samples.to(device)``, ``targets = [{k: v.to(device) for k, v in
t.items()} for t in targets]``, ``outputs = model(samples)``, ``loss_dict = criterion(outputs,
targets)``, ``losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict.keys() if k in
weight_dict)``, ``loss_dict_reduced`` and its ``_unscaled`` / scaled copies,
``loss_value = losses_reduced_scaled.item()``, ``if not math.isfinite(loss_value): ...
sys.exit(1)``, ``optimizer.zero_grad()``, ``losses.backward()``, ``if max_norm > 0:
clip_grad_norm_(model.parameters(), max_norm)``, ``optimizer.step()`` and the three
``metric_logger.update`` calls. What a user of stepgraph changes: that body is decorated with
``sg.compile`` (= ``@stepgraph.compile``); the metric logger is made per epoch outside, as
``train_one_epoch`` does, and the body reads it from the enclosing scope. ``log_every``'s
printing is left out (its iteration is the loop); the epoch's ``gather_stats`` line is logged.

The model is a tiny DETR-like network (the brief allows it: torchvision is not installable here):
a two-conv backbone (``backbone`` prefix: it gets ``lr_backbone``), DETR's ``PositionEmbeddingSine``
(normalize=True), ``input_proj`` 1x1 conv, a post-norm ``nn.TransformerEncoder`` and a stack of
``nn.TransformerDecoderLayer`` whose every output goes through the shared decoder norm (DETR's
``return_intermediate``), queries from ``query_embed.weight`` as the decoder input (DETR adds them
as ``query_pos`` at every layer; ``nn.TransformerDecoderLayer`` has no such input), ``class_embed``
and the 3-layer ``MLP`` box head with ``.sigmoid()``, ``aux_loss=True`` (DETR's default). xavier_uniform
on the transformer's matrices as DETR's ``_reset_parameters``. Images all the same size, so the
padding mask is all False (no ``NestedTensor``). Data: synthetic 32x32 images with 1-3 boxes each
(cxcywh in [0, 1], a varying number per image, as COCO has), labels in ``[0, num_classes)``.
Scaled down: hidden_dim 256 -> 16, nheads 8 -> 2, enc/dec layers 6 -> 1/2, dim_feedforward 2048 -> 32,
num_queries 100 -> 5, num_classes 91 -> 4, batch 2 (as DETR), 4 batches an epoch, lr_drop 200 -> 1.

Source: https://github.com/facebookresearch/detr/blob/29901c51d7fe8712168b8d0d64351170bc0f83e0/engine.py
(and models/matcher.py, models/detr.py, models/position_encoding.py, util/box_ops.py, util/misc.py,
main.py at that commit), Apache-2.0. Restated after the source, not copied.
"""
import math
import sys
from collections import defaultdict, deque

import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import nn

SOURCE = "https://github.com/facebookresearch/detr/blob/29901c51d7fe8712168b8d0d64351170bc0f83e0/engine.py"
LICENSE = "Apache-2.0"
DEVICES = ("cpu", "cuda")
TAGS = ("detection", "transformer", "hungarian-matching", "scipy-in-step", "cpu-numpy-in-step", "list-of-dicts-targets",
        "varying-target-sizes", "item-in-step", "isfinite-check", "sys-exit-branch", "assert-on-tensor",
        "aux-losses", "meters-in-step", "clip-grad-norm", "adamw", "param-groups", "dropout")


class args:  # main.py's defaults, scaled down
    lr = 1e-4; lr_backbone = 1e-5; batch_size = 2; weight_decay = 1e-4; epochs = 2; lr_drop = 1
    clip_max_norm = 0.1; enc_layers = 1; dec_layers = 2; dim_feedforward = 32; hidden_dim = 16; dropout = 0.1
    nheads = 2; num_queries = 5; aux_loss = True; set_cost_class = 1; set_cost_bbox = 5; set_cost_giou = 2
    bbox_loss_coef = 5; giou_loss_coef = 2; eos_coef = 0.1


num_classes = 4
batches_per_epoch = 4


# ---------------------------------------------------------------- util/box_ops.py (restated)

def box_area(boxes):   # (torchvision.ops.boxes.box_area)
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


def box_cxcywh_to_xyxy(x):
    x_c, y_c, w, h = x.unbind(-1)
    b = [(x_c - 0.5 * w), (y_c - 0.5 * h), (x_c + 0.5 * w), (y_c + 0.5 * h)]
    return torch.stack(b, dim=-1)


def box_iou(boxes1, boxes2):
    area1 = box_area(boxes1)
    area2 = box_area(boxes2)
    lt = torch.max(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.min(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[:, :, 0] * wh[:, :, 1]
    union = area1[:, None] + area2 - inter
    iou = inter / union
    return iou, union


def generalized_box_iou(boxes1, boxes2):
    # degenerate boxes give inf / nan: checked first
    assert (boxes1[:, 2:] >= boxes1[:, :2]).all()
    assert (boxes2[:, 2:] >= boxes2[:, :2]).all()
    iou, union = box_iou(boxes1, boxes2)
    lt = torch.min(boxes1[:, None, :2], boxes2[:, :2])
    rb = torch.max(boxes1[:, None, 2:], boxes2[:, 2:])
    wh = (rb - lt).clamp(min=0)
    area = wh[:, :, 0] * wh[:, :, 1]
    return iou - (area - union) / area


# ---------------------------------------------------------------- util/misc.py (restated, world size 1)

def is_dist_avail_and_initialized():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def get_world_size():
    return torch.distributed.get_world_size() if is_dist_avail_and_initialized() else 1


def reduce_dict(input_dict, average=True):
    world_size = get_world_size()
    if world_size < 2:
        return input_dict
    raise NotImplementedError   # (the all_reduce path: not exercised in one process)


@torch.no_grad()
def accuracy(output, target, topk=(1,)):
    if target.numel() == 0:
        return [torch.zeros([], device=output.device)]
    maxk = max(topk)
    batch_size = target.size(0)
    _, pred = output.topk(maxk, 1, True, True)
    pred = pred.t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    res = []
    for k in topk:
        correct_k = correct[:k].view(-1).float().sum(0)
        res.append(correct_k.mul_(100.0 / batch_size))
    return res


class SmoothedValue(object):
    def __init__(self, window_size=20, fmt=None):
        if fmt is None:
            fmt = "{median:.4f} ({global_avg:.4f})"
        self.deque = deque(maxlen=window_size)
        self.total = 0.0
        self.count = 0
        self.fmt = fmt

    def update(self, value, n=1):
        self.deque.append(value)
        self.count += n
        self.total += value * n

    @property
    def global_avg(self):
        return self.total / self.count


class MetricLogger(object):
    def __init__(self, delimiter="\t"):
        self.meters = defaultdict(SmoothedValue)
        self.delimiter = delimiter

    def update(self, **kwargs):
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            assert isinstance(v, (float, int))
            self.meters[k].update(v)

    def add_meter(self, name, meter):
        self.meters[name] = meter


# ---------------------------------------------------------------- models/matcher.py (restated)

class HungarianMatcher(nn.Module):
    def __init__(self, cost_class: float = 1, cost_bbox: float = 1, cost_giou: float = 1):
        super().__init__()
        self.cost_class = cost_class
        self.cost_bbox = cost_bbox
        self.cost_giou = cost_giou
        assert cost_class != 0 or cost_bbox != 0 or cost_giou != 0, "all costs cant be 0"

    @torch.no_grad()
    def forward(self, outputs, targets):
        bs, num_queries = outputs["pred_logits"].shape[:2]
        out_prob = outputs["pred_logits"].flatten(0, 1).softmax(-1)
        out_bbox = outputs["pred_boxes"].flatten(0, 1)
        tgt_ids = torch.cat([v["labels"] for v in targets])
        tgt_bbox = torch.cat([v["boxes"] for v in targets])
        cost_class = -out_prob[:, tgt_ids]
        cost_bbox = torch.cdist(out_bbox, tgt_bbox, p=1)
        cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(out_bbox), box_cxcywh_to_xyxy(tgt_bbox))
        C = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        C = C.view(bs, num_queries, -1).cpu()
        sizes = [len(v["boxes"]) for v in targets]
        indices = [linear_sum_assignment(c[i]) for i, c in enumerate(C.split(sizes, -1))]
        return [(torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)) for i, j in indices]


# ---------------------------------------------------------------- models/detr.py SetCriterion (restated)

class SetCriterion(nn.Module):
    def __init__(self, num_classes, matcher, weight_dict, eos_coef, losses):
        super().__init__()
        self.num_classes = num_classes
        self.matcher = matcher
        self.weight_dict = weight_dict
        self.eos_coef = eos_coef
        self.losses = losses
        empty_weight = torch.ones(self.num_classes + 1)
        empty_weight[-1] = self.eos_coef
        self.register_buffer('empty_weight', empty_weight)

    def loss_labels(self, outputs, targets, indices, num_boxes, log=True):
        assert 'pred_logits' in outputs
        src_logits = outputs['pred_logits']
        idx = self._get_src_permutation_idx(indices)
        target_classes_o = torch.cat([t["labels"][J] for t, (_, J) in zip(targets, indices)])
        target_classes = torch.full(src_logits.shape[:2], self.num_classes, dtype=torch.int64,
                                    device=src_logits.device)
        target_classes[idx] = target_classes_o
        loss_ce = F.cross_entropy(src_logits.transpose(1, 2), target_classes, self.empty_weight)
        losses = {'loss_ce': loss_ce}
        if log:
            losses['class_error'] = 100 - accuracy(src_logits[idx], target_classes_o)[0]
        return losses

    @torch.no_grad()
    def loss_cardinality(self, outputs, targets, indices, num_boxes):
        pred_logits = outputs['pred_logits']
        device = pred_logits.device
        tgt_lengths = torch.as_tensor([len(v["labels"]) for v in targets], device=device)
        card_pred = (pred_logits.argmax(-1) != pred_logits.shape[-1] - 1).sum(1)
        card_err = F.l1_loss(card_pred.float(), tgt_lengths.float())
        return {'cardinality_error': card_err}

    def loss_boxes(self, outputs, targets, indices, num_boxes):
        assert 'pred_boxes' in outputs
        idx = self._get_src_permutation_idx(indices)
        src_boxes = outputs['pred_boxes'][idx]
        target_boxes = torch.cat([t['boxes'][i] for t, (_, i) in zip(targets, indices)], dim=0)
        loss_bbox = F.l1_loss(src_boxes, target_boxes, reduction='none')
        losses = {}
        losses['loss_bbox'] = loss_bbox.sum() / num_boxes
        loss_giou = 1 - torch.diag(generalized_box_iou(box_cxcywh_to_xyxy(src_boxes),
                                                       box_cxcywh_to_xyxy(target_boxes)))
        losses['loss_giou'] = loss_giou.sum() / num_boxes
        return losses

    def _get_src_permutation_idx(self, indices):
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        src_idx = torch.cat([src for (src, _) in indices])
        return batch_idx, src_idx

    def get_loss(self, loss, outputs, targets, indices, num_boxes, **kwargs):
        loss_map = {'labels': self.loss_labels, 'cardinality': self.loss_cardinality, 'boxes': self.loss_boxes}
        assert loss in loss_map, f'do you really want to compute {loss} loss?'
        return loss_map[loss](outputs, targets, indices, num_boxes, **kwargs)

    def forward(self, outputs, targets):
        outputs_without_aux = {k: v for k, v in outputs.items() if k != 'aux_outputs'}
        indices = self.matcher(outputs_without_aux, targets)
        num_boxes = sum(len(t["labels"]) for t in targets)
        num_boxes = torch.as_tensor([num_boxes], dtype=torch.float, device=next(iter(outputs.values())).device)
        if is_dist_avail_and_initialized():
            torch.distributed.all_reduce(num_boxes)
        num_boxes = torch.clamp(num_boxes / get_world_size(), min=1).item()
        losses = {}
        for loss in self.losses:
            losses.update(self.get_loss(loss, outputs, targets, indices, num_boxes))
        if 'aux_outputs' in outputs:
            for i, aux_outputs in enumerate(outputs['aux_outputs']):
                indices = self.matcher(aux_outputs, targets)
                for loss in self.losses:
                    kwargs = {}
                    if loss == 'labels':
                        kwargs = {'log': False}   # logging only for the last layer
                    l_dict = self.get_loss(loss, aux_outputs, targets, indices, num_boxes, **kwargs)
                    l_dict = {k + f'_{i}': v for k, v in l_dict.items()}
                    losses.update(l_dict)
        return losses


# ---------------------------------------------------------------- a tiny DETR-like model

class PositionEmbeddingSine(nn.Module):   # models/position_encoding.py
    def __init__(self, num_pos_feats=64, temperature=10000, normalize=False, scale=None):
        super().__init__()
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.normalize = normalize
        if scale is not None and normalize is False:
            raise ValueError("normalize should be True if scale is passed")
        if scale is None:
            scale = 2 * math.pi
        self.scale = scale

    def forward(self, x, mask):
        assert mask is not None
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        if self.normalize:
            eps = 1e-6
            y_embed = y_embed / (y_embed[:, -1:, :] + eps) * self.scale
            x_embed = x_embed / (x_embed[:, :, -1:] + eps) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=x.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x = x_embed[:, :, :, None] / dim_t
        pos_y = y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


class MLP(nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim, num_layers):
        super().__init__()
        self.num_layers = num_layers
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k) for n, k in zip([input_dim] + h, h + [output_dim]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < self.num_layers - 1 else layer(x)
        return x


class Backbone(nn.Module):
    def __init__(self, num_channels=32):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(inplace=True),
                                  nn.Conv2d(16, num_channels, 3, stride=2, padding=1), nn.ReLU(inplace=True))
        self.num_channels = num_channels

    def forward(self, x):
        return self.body(x)


class TinyDETR(nn.Module):
    def __init__(self, num_classes, num_queries, d_model, nhead, enc_layers, dec_layers, dim_ff, dropout,
                 aux_loss=True):
        super().__init__()
        self.num_queries = num_queries
        self.backbone = Backbone()
        self.position_embedding = PositionEmbeddingSine(d_model // 2, normalize=True)
        self.input_proj = nn.Conv2d(self.backbone.num_channels, d_model, kernel_size=1)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d_model, nhead, dim_ff, dropout),
                                             enc_layers, enable_nested_tensor=False)
        self.decoder_layers = nn.ModuleList(nn.TransformerDecoderLayer(d_model, nhead, dim_ff, dropout)
                                            for _ in range(dec_layers))
        self.decoder_norm = nn.LayerNorm(d_model)
        for m in (self.encoder, self.decoder_layers):
            for p in m.parameters():
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)
        self.class_embed = nn.Linear(d_model, num_classes + 1)
        self.bbox_embed = MLP(d_model, d_model, 4, 3)
        self.query_embed = nn.Embedding(num_queries, d_model)
        self.aux_loss = aux_loss

    def forward(self, samples):
        features = self.backbone(samples)
        mask = torch.zeros(features.shape[0], *features.shape[2:], dtype=torch.bool, device=features.device)
        pos = self.position_embedding(features, mask)
        src = self.input_proj(features)
        bs = src.shape[0]
        src = src.flatten(2).permute(2, 0, 1)
        pos = pos.flatten(2).permute(2, 0, 1)
        memory = self.encoder(src + pos, src_key_padding_mask=mask.flatten(1))
        tgt = self.query_embed.weight.unsqueeze(1).repeat(1, bs, 1)
        intermediate = []
        for layer in self.decoder_layers:
            tgt = layer(tgt, memory, memory_key_padding_mask=mask.flatten(1))
            intermediate.append(self.decoder_norm(tgt))
        hs = torch.stack(intermediate).transpose(1, 2)   # [layers, bs, queries, d]
        outputs_class = self.class_embed(hs)
        outputs_coord = self.bbox_embed(hs).sigmoid()
        out = {'pred_logits': outputs_class[-1], 'pred_boxes': outputs_coord[-1]}
        if self.aux_loss:
            out['aux_outputs'] = [{'pred_logits': a, 'pred_boxes': b}
                                  for a, b in zip(outputs_class[:-1], outputs_coord[:-1])]
        return out


def synthetic_batches(n_batches, g, counts=None):
    """``counts``: boxes per image per batch (None: 1-3 at random, as a detection dataset has)."""
    out = []
    for b in range(n_batches):
        samples = torch.rand(args.batch_size, 3, 32, 32, generator=g)
        targets = []
        for i in range(args.batch_size):
            n = counts[b % len(counts)][i] if counts else int(torch.randint(1, 4, (1,), generator=g))
            cxcy = 0.25 + 0.5 * torch.rand(n, 2, generator=g)
            wh = 0.1 + 0.3 * torch.rand(n, 2, generator=g)
            targets.append({"boxes": torch.cat([cxcy, wh], 1),
                            "labels": torch.randint(0, num_classes, (n,), generator=g)})
        out.append((samples, targets))
    return out


BOX_COUNTS = None   # (a variant sets fixed counts)


def main(sg, steps=8, device="cpu", amp=None):
    device = torch.device(device)
    model = TinyDETR(num_classes, args.num_queries, args.hidden_dim, args.nheads, args.enc_layers,
                     args.dec_layers, args.dim_feedforward, args.dropout, aux_loss=args.aux_loss).to(device)
    matcher = HungarianMatcher(cost_class=args.set_cost_class, cost_bbox=args.set_cost_bbox,
                               cost_giou=args.set_cost_giou)
    weight_dict = {'loss_ce': 1, 'loss_bbox': args.bbox_loss_coef}
    weight_dict['loss_giou'] = args.giou_loss_coef
    if args.aux_loss:
        aux_weight_dict = {}
        for i in range(args.dec_layers - 1):
            aux_weight_dict.update({k + f'_{i}': v for k, v in weight_dict.items()})
        weight_dict.update(aux_weight_dict)
    losses = ['labels', 'boxes', 'cardinality']
    criterion = SetCriterion(num_classes, matcher=matcher, weight_dict=weight_dict, eos_coef=args.eos_coef,
                             losses=losses)
    criterion.to(device)
    model_without_ddp = model

    param_dicts = [
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" not in n and p.requires_grad]},
        {"params": [p for n, p in model_without_ddp.named_parameters() if "backbone" in n and p.requires_grad],
         "lr": args.lr_backbone},
    ]
    optimizer = torch.optim.AdamW(param_dicts, lr=args.lr, weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, args.lr_drop)
    sg.track(model=model, criterion=criterion, optimizer=optimizer, lr_scheduler=lr_scheduler)

    g = torch.Generator().manual_seed(1)
    data_loader_train = synthetic_batches(batches_per_epoch, g, BOX_COUNTS)
    max_norm = args.clip_max_norm
    metric_logger = None

    @sg.compile
    def train_batch(samples, targets):   # the body of train_one_epoch's loop
        samples = samples.to(device)
        targets = [{k: v.to(device) for k, v in t.items()} for t in targets]

        outputs = model(samples)
        loss_dict = criterion(outputs, targets)
        weight_dict = criterion.weight_dict
        losses = sum(loss_dict[k] * weight_dict[k] for k in loss_dict.keys() if k in weight_dict)

        # reduce losses over all GPUs for logging purposes
        loss_dict_reduced = reduce_dict(loss_dict)
        loss_dict_reduced_unscaled = {f'{k}_unscaled': v for k, v in loss_dict_reduced.items()}
        loss_dict_reduced_scaled = {k: v * weight_dict[k] for k, v in loss_dict_reduced.items() if k in weight_dict}
        losses_reduced_scaled = sum(loss_dict_reduced_scaled.values())

        loss_value = losses_reduced_scaled.item()

        if not math.isfinite(loss_value):
            print("Loss is {}, stopping training".format(loss_value))
            print(loss_dict_reduced)
            sys.exit(1)

        optimizer.zero_grad()
        losses.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()

        metric_logger.update(loss=loss_value, **loss_dict_reduced_scaled, **loss_dict_reduced_unscaled)
        metric_logger.update(class_error=loss_dict_reduced['class_error'])
        metric_logger.update(lr=optimizer.param_groups[0]["lr"])

    done = 0
    for epoch in range(args.epochs):
        model.train()
        criterion.train()
        metric_logger = MetricLogger(delimiter="  ")
        metric_logger.add_meter('lr', SmoothedValue(window_size=1, fmt='{value:.6f}'))
        metric_logger.add_meter('class_error', SmoothedValue(window_size=1, fmt='{value:.2f}'))
        for samples, targets in data_loader_train:
            train_batch(samples, targets)
            done += 1
            sg.log({k: (m.total, m.count, list(m.deque)) for k, m in metric_logger.meters.items()})
            if done == steps:
                break
        train_stats = {k: meter.global_avg for k, meter in metric_logger.meters.items()}
        sg.log(train_stats)
        lr_scheduler.step()
        if done == steps:
            break
