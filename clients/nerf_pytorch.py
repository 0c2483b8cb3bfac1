"""yenchenlin/nerf-pytorch's ``run_nerf.py``: NeRF training with the whole iteration of
``train()``'s ``for i in trange(start, N_iters)`` loop compiled. The program's pieces as it writes
them: ``get_embedder`` / ``Embedder`` (input plus sin/cos at ``2.**torch.linspace(0, max_freq,
N_freqs)`` frequencies, lambdas with the frequency bound as a default), ``NeRF`` (``pts_linears``
with the skip concatenation, ``use_viewdirs``: ``alpha_linear``, ``feature_linear``,
``views_linears``, ``rgb_linear``), coarse and fine networks from ``create_nerf`` with one Adam
over both (``betas=(0.9, 0.999)``), ``network_query_fn`` -> ``run_network`` -> ``batchify``;
``render`` (viewdirs normalised, near/far columns, ``batchify_rays`` over ``chunk``, reshape and the
``k_extract`` split), ``render_rays`` (stratified ``z_vals`` with ``perturb`` drawing
``torch.rand``, ``raw2outputs`` with its ``torch.Tensor([1e10])`` distance and ``cumprod``
transmittance, white background, hierarchical ``sample_pdf`` with ``torch.searchsorted`` and
``torch.rand``, the ``z_std``, and the NaN/Inf check ``if (torch.isnan(ret[k]).any() or
torch.isinf(ret[k]).any()) and DEBUG``), ``get_rays``, ``img2mse``, ``mse2psnr``.

The loop body, as ``run_nerf.py`` writes it: ``time0 = time.time()``; the random ray batch -- for
the blender/lego config (``no_batching``) ``img_i = np.random.choice(i_train)``,
``torch.Tensor(target)``, ``get_rays`` of the pose, the centre crop while ``i <
args.precrop_iters`` (and its ``[Config]`` print at ``i == start``), ``select_inds =
np.random.choice(coords.shape[0], size=[N_rand], replace=False)``; for the llff config
(``use_batching``) the slice ``rays_rgb[i_batch:i_batch+N_rand]``, ``i_batch += N_rand`` and, at the
end of the rays, ``torch.randperm`` reshuffling ``rays_rgb``; then ``render(...,
verbose=i < 10, retraw=True, **render_kwargs_train)``, ``zero_grad``, ``img2mse``,
``mse2psnr``, the ``rgb0`` coarse loss, ``backward``, ``step``, ``new_lrate = args.lrate *
(decay_rate ** (global_step / decay_steps))`` assigned to every param group, ``dt``, and ``if
i%args.i_print==0: tqdm.write(f"[TRAIN] Iter: {i} Loss: {loss.item()}  PSNR: {psnr.item()}")``;
``global_step += 1``.

What a user of stepgraph changes: that body is ``train_iter(i)``, decorated with ``sg.compile``;
the loop's rebound locals (``global_step``, ``i_batch``, ``rays_rgb``) are ``nonlocal``.
Variants (``main``'s keywords; clients ``nerf_pytorch_batching``, ``nerf_pytorch_rays_outside``):
``batching=True`` is the llff config's ray batching; ``rays_outside=True`` draws the lego config's
ray batch in the loop and passes ``batch_rays, target_s`` to the step (the fix stepgraph names for
the default).

Scaled down / replaced: synthetic blender-like data (3 training views of 16x16 RGB images (8x8 with batching), camera
poses on a circle at radius 4 looking at the origin, ``focal`` 10, near 2, far 6, white
background), no checkpoints / videos / test renders / SummaryWriter (``i_weights``, ``i_video``,
``i_testset`` past the run); ``tqdm.write`` is ``print``. Config (lego's ``config_lego.txt`` and the
parser's defaults): ``use_viewdirs``, ``white_bkgd``, ``lrate`` 5e-4, ``lrate_decay`` 500,
``perturb`` 1, ``raw_noise_std`` 0 (llff: 1.0); scaled: ``netdepth``/``netdepth_fine`` 8 -> 3,
``netwidth`` 256 -> 32, skips [4] -> [1], ``multires`` 10 -> 4, ``multires_views`` 4 -> 2,
``N_samples`` 64 -> 8, ``N_importance`` 128 -> 8, ``N_rand`` 1024 -> 32, ``chunk`` 32768 -> 16 (two
chunks per batch), ``netchunk`` 65536 -> 256, ``precrop_iters`` 500 -> 4, ``i_print`` 100 -> 3;
``verbose`` prints of ``render_rays`` are not in this version of it.

Source: https://github.com/yenchenlin/nerf-pytorch/blob/0089202d8ba3e34556f870119cd7e4c89c208d16/run_nerf.py
and run_nerf_helpers.py (MIT License, Copyright (c) 2020 Yen-Chen Lin). Restated after the source,
not copied.
"""
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

SOURCE = "https://github.com/yenchenlin/nerf-pytorch/blob/0089202d8ba3e34556f870119cd7e4c89c208d16/run_nerf.py"
LICENSE = "MIT"
# (CPU only: run_nerf.py makes CUDA tensors with torch.set_default_tensor_type('torch.cuda.FloatTensor'),
# which torch 2.x deprecates; under set_default_device('cuda') the program's legacy torch.Tensor(pose)
# of a CUDA pose fails in eager -- the restatement keeps the program's constructors)
DEVICES = ("cpu",)
TAGS = ("nerf", "mlp", "positional-encoding", "volume-rendering", "hierarchical-sampling", "searchsorted",
        "numpy-random-in-step", "torch-rand-in-step", "manual-lr", "lr-in-step", "item-in-step", "print-in-step",
        "time-in-step", "nonlocal-rebound", "adam", "two-networks-one-optimizer")

DEBUG = False


# --- run_nerf_helpers.py ---

img2mse = lambda x, y: torch.mean((x - y) ** 2)
mse2psnr = lambda x: -10. * torch.log(x) / torch.log(torch.Tensor([10.]))
to8b = lambda x: (255 * np.clip(x, 0, 1)).astype(np.uint8)


class Embedder:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.create_embedding_fn()

    def create_embedding_fn(self):
        embed_fns = []
        d = self.kwargs['input_dims']
        out_dim = 0
        if self.kwargs['include_input']:
            embed_fns.append(lambda x: x)
            out_dim += d
        max_freq = self.kwargs['max_freq_log2']
        N_freqs = self.kwargs['num_freqs']
        if self.kwargs['log_sampling']:
            freq_bands = 2. ** torch.linspace(0., max_freq, steps=N_freqs)
        else:
            freq_bands = torch.linspace(2. ** 0., 2. ** max_freq, steps=N_freqs)
        for freq in freq_bands:
            for p_fn in self.kwargs['periodic_fns']:
                embed_fns.append(lambda x, p_fn=p_fn, freq=freq: p_fn(x * freq))
                out_dim += d
        self.embed_fns = embed_fns
        self.out_dim = out_dim

    def embed(self, inputs):
        return torch.cat([fn(inputs) for fn in self.embed_fns], -1)


def get_embedder(multires, i=0):
    if i == -1:
        return nn.Identity(), 3
    embed_kwargs = {
        'include_input': True,
        'input_dims': 3,
        'max_freq_log2': multires - 1,
        'num_freqs': multires,
        'log_sampling': True,
        'periodic_fns': [torch.sin, torch.cos],
    }
    embedder_obj = Embedder(**embed_kwargs)
    embed = lambda x, eo=embedder_obj: eo.embed(x)
    return embed, embedder_obj.out_dim


class NeRF(nn.Module):
    def __init__(self, D=8, W=256, input_ch=3, input_ch_views=3, output_ch=4, skips=[4], use_viewdirs=False):
        super(NeRF, self).__init__()
        self.D = D
        self.W = W
        self.input_ch = input_ch
        self.input_ch_views = input_ch_views
        self.skips = skips
        self.use_viewdirs = use_viewdirs
        self.pts_linears = nn.ModuleList(
            [nn.Linear(input_ch, W)] + [nn.Linear(W, W) if i not in self.skips else nn.Linear(W + input_ch, W)
                                        for i in range(D - 1)])
        self.views_linears = nn.ModuleList([nn.Linear(input_ch_views + W, W // 2)])
        if use_viewdirs:
            self.feature_linear = nn.Linear(W, W)
            self.alpha_linear = nn.Linear(W, 1)
            self.rgb_linear = nn.Linear(W // 2, 3)
        else:
            self.output_linear = nn.Linear(W, output_ch)

    def forward(self, x):
        input_pts, input_views = torch.split(x, [self.input_ch, self.input_ch_views], dim=-1)
        h = input_pts
        for i, l in enumerate(self.pts_linears):
            h = self.pts_linears[i](h)
            h = F.relu(h)
            if i in self.skips:
                h = torch.cat([input_pts, h], -1)
        if self.use_viewdirs:
            alpha = self.alpha_linear(h)
            feature = self.feature_linear(h)
            h = torch.cat([feature, input_views], -1)
            for i, l in enumerate(self.views_linears):
                h = self.views_linears[i](h)
                h = F.relu(h)
            rgb = self.rgb_linear(h)
            outputs = torch.cat([rgb, alpha], -1)
        else:
            outputs = self.output_linear(h)
        return outputs


def get_rays(H, W, K, c2w):
    i, j = torch.meshgrid(torch.linspace(0, W - 1, W), torch.linspace(0, H - 1, H), indexing='ij')
    i = i.t()
    j = j.t()
    dirs = torch.stack([(i - K[0][2]) / K[0][0], -(j - K[1][2]) / K[1][1], -torch.ones_like(i)], -1)
    rays_d = torch.sum(dirs[..., np.newaxis, :] * c2w[:3, :3], -1)
    rays_o = c2w[:3, -1].expand(rays_d.shape)
    return rays_o, rays_d


def get_rays_np(H, W, K, c2w):
    i, j = np.meshgrid(np.arange(W, dtype=np.float32), np.arange(H, dtype=np.float32), indexing='xy')
    dirs = np.stack([(i - K[0][2]) / K[0][0], -(j - K[1][2]) / K[1][1], -np.ones_like(i)], -1)
    rays_d = np.sum(dirs[..., np.newaxis, :] * c2w[:3, :3], -1)
    rays_o = np.broadcast_to(c2w[:3, -1], np.shape(rays_d))
    return rays_o, rays_d


def sample_pdf(bins, weights, N_samples, det=False, pytest=False):
    weights = weights + 1e-5  # prevent nans
    pdf = weights / torch.sum(weights, -1, keepdim=True)
    cdf = torch.cumsum(pdf, -1)
    cdf = torch.cat([torch.zeros_like(cdf[..., :1]), cdf], -1)
    if det:
        u = torch.linspace(0., 1., steps=N_samples)
        u = u.expand(list(cdf.shape[:-1]) + [N_samples])
    else:
        u = torch.rand(list(cdf.shape[:-1]) + [N_samples])
    u = u.contiguous()
    inds = torch.searchsorted(cdf, u, right=True)
    below = torch.max(torch.zeros_like(inds - 1), inds - 1)
    above = torch.min((cdf.shape[-1] - 1) * torch.ones_like(inds), inds)
    inds_g = torch.stack([below, above], -1)
    matched_shape = [inds_g.shape[0], inds_g.shape[1], cdf.shape[-1]]
    cdf_g = torch.gather(cdf.unsqueeze(1).expand(matched_shape), 2, inds_g)
    bins_g = torch.gather(bins.unsqueeze(1).expand(matched_shape), 2, inds_g)
    denom = (cdf_g[..., 1] - cdf_g[..., 0])
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    t = (u - cdf_g[..., 0]) / denom
    samples = bins_g[..., 0] + t * (bins_g[..., 1] - bins_g[..., 0])
    return samples


# --- run_nerf.py ---

def batchify(fn, chunk):
    if chunk is None:
        return fn

    def ret(inputs):
        return torch.cat([fn(inputs[i:i + chunk]) for i in range(0, inputs.shape[0], chunk)], 0)
    return ret


def run_network(inputs, viewdirs, fn, embed_fn, embeddirs_fn, netchunk=1024 * 64):
    inputs_flat = torch.reshape(inputs, [-1, inputs.shape[-1]])
    embedded = embed_fn(inputs_flat)
    if viewdirs is not None:
        input_dirs = viewdirs[:, None].expand(inputs.shape)
        input_dirs_flat = torch.reshape(input_dirs, [-1, input_dirs.shape[-1]])
        embedded_dirs = embeddirs_fn(input_dirs_flat)
        embedded = torch.cat([embedded, embedded_dirs], -1)
    outputs_flat = batchify(fn, netchunk)(embedded)
    outputs = torch.reshape(outputs_flat, list(inputs.shape[:-1]) + [outputs_flat.shape[-1]])
    return outputs


def batchify_rays(rays_flat, chunk=1024 * 32, **kwargs):
    all_ret = {}
    for i in range(0, rays_flat.shape[0], chunk):
        ret = render_rays(rays_flat[i:i + chunk], **kwargs)
        for k in ret:
            if k not in all_ret:
                all_ret[k] = []
            all_ret[k].append(ret[k])
    all_ret = {k: torch.cat(all_ret[k], 0) for k in all_ret}
    return all_ret


def render(H, W, K, chunk=1024 * 32, rays=None, c2w=None, ndc=True, near=0., far=1., use_viewdirs=False,
           c2w_staticcam=None, **kwargs):
    if c2w is not None:
        rays_o, rays_d = get_rays(H, W, K, c2w)
    else:
        rays_o, rays_d = rays
    if use_viewdirs:
        viewdirs = rays_d
        if c2w_staticcam is not None:
            rays_o, rays_d = get_rays(H, W, K, c2w_staticcam)
        viewdirs = viewdirs / torch.norm(viewdirs, dim=-1, keepdim=True)
        viewdirs = torch.reshape(viewdirs, [-1, 3]).float()
    sh = rays_d.shape  # [..., 3]
    # (ndc_rays: only for llff forward-facing scenes; off here, as for blender)
    rays_o = torch.reshape(rays_o, [-1, 3]).float()
    rays_d = torch.reshape(rays_d, [-1, 3]).float()
    near, far = near * torch.ones_like(rays_d[..., :1]), far * torch.ones_like(rays_d[..., :1])
    rays = torch.cat([rays_o, rays_d, near, far], -1)
    if use_viewdirs:
        rays = torch.cat([rays, viewdirs], -1)
    all_ret = batchify_rays(rays, chunk, **kwargs)
    for k in all_ret:
        k_sh = list(sh[:-1]) + list(all_ret[k].shape[1:])
        all_ret[k] = torch.reshape(all_ret[k], k_sh)
    k_extract = ['rgb_map', 'disp_map', 'acc_map']
    ret_list = [all_ret[k] for k in k_extract]
    ret_dict = {k: all_ret[k] for k in all_ret if k not in k_extract}
    return ret_list + [ret_dict]


def raw2outputs(raw, z_vals, rays_d, raw_noise_std=0, white_bkgd=False, pytest=False):
    raw2alpha = lambda raw, dists, act_fn=F.relu: 1. - torch.exp(-act_fn(raw) * dists)
    dists = z_vals[..., 1:] - z_vals[..., :-1]
    dists = torch.cat([dists, torch.Tensor([1e10]).expand(dists[..., :1].shape)], -1)  # [N_rays, N_samples]
    dists = dists * torch.norm(rays_d[..., None, :], dim=-1)
    rgb = torch.sigmoid(raw[..., :3])  # [N_rays, N_samples, 3]
    noise = 0.
    if raw_noise_std > 0.:
        noise = torch.randn(raw[..., 3].shape) * raw_noise_std
    alpha = raw2alpha(raw[..., 3] + noise, dists)  # [N_rays, N_samples]
    weights = alpha * torch.cumprod(torch.cat([torch.ones((alpha.shape[0], 1)), 1. - alpha + 1e-10], -1), -1)[:, :-1]
    rgb_map = torch.sum(weights[..., None] * rgb, -2)  # [N_rays, 3]
    depth_map = torch.sum(weights * z_vals, -1)
    disp_map = 1. / torch.max(1e-10 * torch.ones_like(depth_map), depth_map / torch.sum(weights, -1))
    acc_map = torch.sum(weights, -1)
    if white_bkgd:
        rgb_map = rgb_map + (1. - acc_map[..., None])
    return rgb_map, disp_map, acc_map, weights, depth_map


def render_rays(ray_batch, network_fn, network_query_fn, N_samples, retraw=False, lindisp=False, perturb=0.,
                N_importance=0, network_fine=None, white_bkgd=False, raw_noise_std=0., verbose=False, pytest=False):
    N_rays = ray_batch.shape[0]
    rays_o, rays_d = ray_batch[:, 0:3], ray_batch[:, 3:6]  # [N_rays, 3] each
    viewdirs = ray_batch[:, -3:] if ray_batch.shape[-1] > 8 else None
    bounds = torch.reshape(ray_batch[..., 6:8], [-1, 1, 2])
    near, far = bounds[..., 0], bounds[..., 1]  # [-1,1]
    t_vals = torch.linspace(0., 1., steps=N_samples)
    if not lindisp:
        z_vals = near * (1. - t_vals) + far * (t_vals)
    else:
        z_vals = 1. / (1. / near * (1. - t_vals) + 1. / far * (t_vals))
    z_vals = z_vals.expand([N_rays, N_samples])
    if perturb > 0.:
        # get intervals between samples
        mids = .5 * (z_vals[..., 1:] + z_vals[..., :-1])
        upper = torch.cat([mids, z_vals[..., -1:]], -1)
        lower = torch.cat([z_vals[..., :1], mids], -1)
        # stratified samples in those intervals
        t_rand = torch.rand(z_vals.shape)
        z_vals = lower + (upper - lower) * t_rand
    pts = rays_o[..., None, :] + rays_d[..., None, :] * z_vals[..., :, None]  # [N_rays, N_samples, 3]
    raw = network_query_fn(pts, viewdirs, network_fn)
    rgb_map, disp_map, acc_map, weights, depth_map = raw2outputs(raw, z_vals, rays_d, raw_noise_std, white_bkgd,
                                                                 pytest=pytest)
    if N_importance > 0:
        rgb_map_0, disp_map_0, acc_map_0 = rgb_map, disp_map, acc_map
        z_vals_mid = .5 * (z_vals[..., 1:] + z_vals[..., :-1])
        z_samples = sample_pdf(z_vals_mid, weights[..., 1:-1], N_importance, det=(perturb == 0.), pytest=pytest)
        z_samples = z_samples.detach()
        z_vals, _ = torch.sort(torch.cat([z_vals, z_samples], -1), -1)
        pts = rays_o[..., None, :] + rays_d[..., None, :] * z_vals[..., :, None]
        run_fn = network_fn if network_fine is None else network_fine
        raw = network_query_fn(pts, viewdirs, run_fn)
        rgb_map, disp_map, acc_map, weights, depth_map = raw2outputs(raw, z_vals, rays_d, raw_noise_std,
                                                                     white_bkgd, pytest=pytest)
    ret = {'rgb_map': rgb_map, 'disp_map': disp_map, 'acc_map': acc_map}
    if retraw:
        ret['raw'] = raw
    if N_importance > 0:
        ret['rgb0'] = rgb_map_0
        ret['disp0'] = disp_map_0
        ret['acc0'] = acc_map_0
        ret['z_std'] = torch.std(z_samples, dim=-1, unbiased=False)  # [N_rays]
    for k in ret:
        if (torch.isnan(ret[k]).any() or torch.isinf(ret[k]).any()) and DEBUG:
            print(f"! [Numerical Error] {k} contains nan or inf.")
    return ret


class Args:   # config_lego.txt / the parser's defaults, scaled down (see the docstring)
    netdepth = 3; netwidth = 32; netdepth_fine = 3; netwidth_fine = 32
    N_rand = 32; lrate = 5e-4; lrate_decay = 500; chunk = 16; netchunk = 256; no_batching = True
    perturb = 1.; use_viewdirs = True; i_embed = 0; multires = 4; multires_views = 2; raw_noise_std = 0.
    N_samples = 8; N_importance = 8; white_bkgd = True; lindisp = False
    precrop_iters = 4; precrop_frac = .5; i_print = 3


def create_nerf(args):
    embed_fn, input_ch = get_embedder(args.multires, args.i_embed)
    input_ch_views = 0
    embeddirs_fn = None
    if args.use_viewdirs:
        embeddirs_fn, input_ch_views = get_embedder(args.multires_views, args.i_embed)
    output_ch = 5 if args.N_importance > 0 else 4
    skips = [1]   # [4]
    model = NeRF(D=args.netdepth, W=args.netwidth, input_ch=input_ch, output_ch=output_ch, skips=skips,
                 input_ch_views=input_ch_views, use_viewdirs=args.use_viewdirs)
    grad_vars = list(model.parameters())
    model_fine = None
    if args.N_importance > 0:
        model_fine = NeRF(D=args.netdepth_fine, W=args.netwidth_fine, input_ch=input_ch, output_ch=output_ch,
                          skips=skips, input_ch_views=input_ch_views, use_viewdirs=args.use_viewdirs)
        grad_vars += list(model_fine.parameters())
    network_query_fn = lambda inputs, viewdirs, network_fn: run_network(inputs, viewdirs, network_fn,
                                                                         embed_fn=embed_fn,
                                                                         embeddirs_fn=embeddirs_fn,
                                                                         netchunk=args.netchunk)
    optimizer = torch.optim.Adam(params=grad_vars, lr=args.lrate, betas=(0.9, 0.999))
    start = 0
    render_kwargs_train = {
        'network_query_fn': network_query_fn,
        'perturb': args.perturb,
        'N_importance': args.N_importance,
        'network_fine': model_fine,
        'N_samples': args.N_samples,
        'network_fn': model,
        'use_viewdirs': args.use_viewdirs,
        'white_bkgd': args.white_bkgd,
        'raw_noise_std': args.raw_noise_std,
    }
    render_kwargs_train['ndc'] = False
    render_kwargs_train['lindisp'] = args.lindisp
    return render_kwargs_train, start, grad_vars, optimizer


def synthetic_blender(n=4, H=8, W=8, focal=10.):
    """Stands in for load_blender_data: RGBA images and camera-to-world poses on a circle."""
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, size=(n, H, W, 4)).astype(np.float32)
    poses = []
    for k in range(n):
        th = 2 * np.pi * k / n
        c, s = np.cos(th), np.sin(th)
        rot = np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]], dtype=np.float32)
        pose = np.eye(4, dtype=np.float32)
        pose[:3, :3] = rot
        pose[:3, 3] = rot @ np.array([0, 0, 4.], dtype=np.float32)
        poses.append(pose)
    return images, np.stack(poses), [H, W, focal], [np.arange(n - 1), np.array([n - 1]), np.array([n - 1])]


def main(sg, steps=8, device="cpu", amp=None, batching=False, rays_outside=False):
    args = Args()
    if batching:    # (the llff config: ray batching, raw_noise_std 1e0)
        args.no_batching = False
        args.raw_noise_std = 1.
    torch.set_default_device(device)
    try:
        _train(sg, steps, device, args, rays_outside)
    finally:
        torch.set_default_device(None)


def _train(sg, steps, device, args, rays_outside):
    # (16x16 views for lego's centre crop to hold N_rand pixels; 8x8 for llff's batching so that the
    # rays run out, and are reshuffled, within the run)
    images, poses, hwf, i_split = synthetic_blender(H=8 if not args.no_batching else 16,
                                                    W=8 if not args.no_batching else 16)
    i_train, i_val, i_test = i_split
    near, far = 2., 6.
    images = images[..., :3] * images[..., -1:] + (1. - images[..., -1:])   # white_bkgd
    H, W, focal = hwf
    H, W = int(H), int(W)
    K = np.array([[focal, 0, 0.5 * W], [0, focal, 0.5 * H], [0, 0, 1]])

    render_kwargs_train, start, grad_vars, optimizer = create_nerf(args)
    global_step = start
    render_kwargs_train.update({'near': near, 'far': far})
    sg.track(network_fn=render_kwargs_train['network_fn'], network_fine=render_kwargs_train['network_fine'],
             optimizer=optimizer)

    N_rand = args.N_rand
    use_batching = not args.no_batching
    rays_rgb = None
    i_batch = 0
    if use_batching:
        rays = np.stack([get_rays_np(H, W, K, p) for p in poses[:, :3, :4]], 0)
        rays_rgb = np.concatenate([rays, images[:, None]], 1)
        rays_rgb = np.transpose(rays_rgb, [0, 2, 3, 1, 4])
        rays_rgb = np.stack([rays_rgb[i] for i in i_train], 0)
        rays_rgb = np.reshape(rays_rgb, [-1, 3, 3])
        rays_rgb = rays_rgb.astype(np.float32)
        np.random.shuffle(rays_rgb)
        i_batch = 0
    if use_batching:
        images = torch.Tensor(images).to(device)
    poses = torch.Tensor(poses).to(device)
    if use_batching:
        rays_rgb = torch.Tensor(rays_rgb).to(device)

    def sample_rays(i):
        # (the "Random from one image" branch, as run_nerf.py writes it)
        img_i = np.random.choice(i_train)
        target = images[img_i]
        target = torch.Tensor(target).to(device)
        pose = poses[img_i, :3, :4]
        rays_o, rays_d = get_rays(H, W, K, torch.Tensor(pose))
        if i < args.precrop_iters:
            dH = int(H // 2 * args.precrop_frac)
            dW = int(W // 2 * args.precrop_frac)
            coords = torch.stack(torch.meshgrid(torch.linspace(H // 2 - dH, H // 2 + dH - 1, 2 * dH),
                                                torch.linspace(W // 2 - dW, W // 2 + dW - 1, 2 * dW),
                                                indexing='ij'), -1)
            if i == start:
                print(f"[Config] Center cropping of size {2 * dH} x {2 * dW} is enabled until iter "
                      f"{args.precrop_iters}")
        else:
            coords = torch.stack(torch.meshgrid(torch.linspace(0, H - 1, H), torch.linspace(0, W - 1, W),
                                                indexing='ij'), -1)
        coords = torch.reshape(coords, [-1, 2])
        select_inds = np.random.choice(coords.shape[0], size=[N_rand], replace=False)
        select_coords = coords[select_inds].long()
        rays_o = rays_o[select_coords[:, 0], select_coords[:, 1]]
        rays_d = rays_d[select_coords[:, 0], select_coords[:, 1]]
        batch_rays = torch.stack([rays_o, rays_d], 0)
        target_s = target[select_coords[:, 0], select_coords[:, 1]]
        return batch_rays, target_s

    @sg.compile
    def train_iter(i, batch_rays=None, target_s=None):
        nonlocal global_step, i_batch, rays_rgb
        time0 = time.time()

        # Sample random ray batch
        if batch_rays is not None:
            pass   # (rays_outside: drawn by the loop)
        elif use_batching:
            batch = rays_rgb[i_batch:i_batch + N_rand]
            batch = torch.transpose(batch, 0, 1)
            batch_rays, target_s = batch[:2], batch[2]
            i_batch += N_rand
            if i_batch >= rays_rgb.shape[0]:
                print("Shuffle data after an epoch!")
                rand_idx = torch.randperm(rays_rgb.shape[0])
                rays_rgb = rays_rgb[rand_idx]
                i_batch = 0
        else:
            batch_rays, target_s = sample_rays(i)

        #####  Core optimization loop  #####
        rgb, disp, acc, extras = render(H, W, K, chunk=args.chunk, rays=batch_rays, verbose=i < 10, retraw=True,
                                        **render_kwargs_train)
        optimizer.zero_grad()
        img_loss = img2mse(rgb, target_s)
        trans = extras['raw'][..., -1]
        loss = img_loss
        psnr = mse2psnr(img_loss)
        if 'rgb0' in extras:
            img_loss0 = img2mse(extras['rgb0'], target_s)
            loss = loss + img_loss0
            psnr0 = mse2psnr(img_loss0)
        loss.backward()
        optimizer.step()

        ###   update learning rate   ###
        decay_rate = 0.1
        decay_steps = args.lrate_decay * 1000
        new_lrate = args.lrate * (decay_rate ** (global_step / decay_steps))
        for param_group in optimizer.param_groups:
            param_group['lr'] = new_lrate

        dt = time.time() - time0
        if i % args.i_print == 0:
            print(f"[TRAIN] Iter: {i} Loss: {loss.item()}  PSNR: {psnr.item()}")   # tqdm.write
        global_step += 1
        return loss, psnr

    start = start + 1
    for i in range(start, start + steps):
        if rays_outside:
            batch_rays, target_s = sample_rays(i)
            loss, psnr = train_iter(i, batch_rays, target_s)
        else:
            loss, psnr = train_iter(i)
        sg.log((loss, psnr, global_step, optimizer.param_groups[0]['lr'], i_batch))
    if use_batching:
        sg.log(rays_rgb)
