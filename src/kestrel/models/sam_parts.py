"""The parts SAM and SAM 2 share, written once; each model inherits them under its own name.

``sam.FeedForward3`` and ``sam2.FeedForward3`` are both ``class FeedForward3(sam_parts.FeedForward3)``:
the listing of each program names its own module, the declarations and bodies live here. The
functions below are helpers both models' block functions call (the checker runs them inline).
"""

import math

from ..blocks import Block, Dim, Float, Param
from ..std import ops
from ..std.nn import Linear


class TwoWaySizes(Block, abstract=True):
    """The mask decoder's sizes, declared once for each of its blocks: the token width ``Hd``, the
    heads, which also split the halved width of the cross-attentions, and the MLP width."""

    Hd: Dim
    Heads: Dim
    Inner: Dim
    where = "Heads > 0, Hd % Heads == 0, (Hd / 2) % Heads == 0"


class MaskAttentionHeads(Block, abstract=True):
    """The mask decoder's attention up to its output projection (``out_proj`` in SAM, ``o_proj`` in
    SAM 2, so each model declares its own): query, key and value projected from ``Hd`` to the
    ``Internal`` width, split into ``Heads`` heads."""

    Hd: Dim
    Internal: Dim
    Heads: Dim
    T: Float
    where = "Heads > 0, Internal % Heads == 0"

    q_proj: Linear["Hd, Internal, T"]
    k_proj: Linear["Hd, Internal, T"]
    v_proj: Linear["Hd, Internal, T"]

    def _attend(self, query, key, value, out_proj, key_bias=None):
        """The heads' attention over the projected inputs, joined back to ``Internal`` channels and projected by
        ``out_proj``; ``key_bias`` (``[..., 1, K]``) is added to each key's scores. One op: with few prompt tokens
        on one side, eager inference folds the projections into that side (``ops.projected_attention``)."""
        projections = [(p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj, out_proj)]
        return ops.projected_attention(query, key, value, self.Heads, projections, key_bias)


class LayerNormCHW(Block):
    """Layer norm over the channels of a channels-first map (the neck and the mask upscaling path)."""

    C: Dim
    T: Float
    eps = 1e-6  # fixed upstream, whatever the config says

    weight: Param["C; T"]
    bias: Param["C; T"]

    def forward(self, x: "Tensor[B, C, H, W; T]") -> "Tensor[B, C, H, W; T]":
        return ops.layer_norm_chw(x, self.weight, self.bias, self.eps)


class FeedForward3(Block):
    """Three linear layers with ReLU between them (hypernetworks, IoU and object-score heads)."""

    In: Dim
    Hidden: Dim
    Out: Dim
    T: Float

    proj_in: Linear["In, Hidden, T"]
    hidden: Linear["Hidden, Hidden, T"]
    proj_out: Linear["Hidden, Out, T"]

    def forward(self, x: "Tensor[*S, In; T]") -> "Tensor[*S, Out; T]":
        return self.proj_out(ops.relu(self.hidden(ops.relu(self.proj_in(x)))))


class Deconv2x2(Block):
    """A stride-2 transposed 2 x 2 convolution: each pixel becomes a 2 x 2 block."""

    Cin: Dim
    Cout: Dim
    T: Float
    where = "Cin > 0, Cout > 0"

    weight: Param["Cin, Cout, 2, 2; T"]
    bias: Param["Cout; T"]

    def forward(self, x: "Tensor[B, Cin, H, W; T]") -> "Tensor[B, Cout, 2 * H, 2 * W; T]":
        return ops.conv_transpose2x2(x, self.weight, self.bias)


def _partition(x, win, n):
    """``[B, n * win, n * win, C]`` -> ``[B * n * n, win, win, C]``, window by window."""
    B, C = x.shape[0], x.shape[3]
    x = x.reshape(B, n, win, n, win, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B * n * n, win, win, C)


def _unpartition(w, B, n):
    """The inverse of :func:`_partition`: ``[B * n * n, win, win, C]`` -> ``[B, n * win, n * win, C]``."""
    win, C = w.shape[1], w.shape[3]
    w = w.reshape(B, n, n, win, win, C).permute(0, 1, 3, 2, 4, 5)
    return w.reshape(B, n * win, n * win, C)


def window_attention(attn, h, win, n, pad, side):
    """``attn`` inside each ``win x win`` window of the ``[B, S, S, C]`` map ``h`` zero-padded by ``pad``
    at the bottom and right to ``n`` windows a side, cropped to ``side`` (SAM's windowed layers,
    Hiera's, whose windows may shrink the map)."""
    B = h.shape[0]
    h = ops.pad(h, [0, 0, 0, pad, 0, pad])
    return _unpartition(attn(_partition(h, win, n)), B, n)[:, :side, :side, :]


def fourier(coords, table):
    """Random Fourier features ``[sin, cos](2 pi (2c - 1) G)`` of coordinates in [0, 1] (``G`` the table)."""
    c = ops.matmul(coords * 2 - 1, table) * (2 * math.pi)
    return ops.cat([ops.sin(c), ops.cos(c)], dim=-1)


def two_way_tail(layer, queries, keys, qpe, kpe, image_to_token):
    """A two-way layer after its self-attention: the tokens attend to the image, their MLP, then the
    image attends to the tokens through ``image_to_token(query, key, value)`` (SAM 2's masks padding)."""
    k = keys + kpe
    queries = layer.layer_norm2(queries + layer.cross_attn_token_to_image(queries + qpe, k, keys))
    queries = layer.layer_norm3(queries + layer.mlp(queries))
    return queries, layer.layer_norm4(keys + image_to_token(k, queries + qpe, queries))
