"""SigLIP (Zhai et al., 2023): an image tower and a text tower trained with a pairwise sigmoid loss.

The image tower is a ViT without a class token: patches embedded by a stride-``Patch``
convolution, learnt positions, pre-norm encoder layers, a final norm, then a multihead
attention-pool head (one learnt probe attends over every patch token). The text tower embeds
``MaxPositions`` tokens, runs its own encoder, a final norm, and projects the LAST token (SigLIP
pads with eos to a fixed length, so that is padding or eos). ``similarity`` compares the
l2-normalised features: ``text @ image.T * exp(logit_scale) + logit_bias``, one logit per
(text, image) pair; its sigmoid is the probability that the text describes the image.
"""

from ..blocks import Array, Block, Dim, Float, Param, entry, f32
from ..std import ops
from ..std.nn import Linear, transformer


class LayerNorm(transformer.LayerNorm):
    pass


class Mlp(Block):
    """``down(gelu(up(x)))``, GELU with the tanh approximation as SigLIP is trained."""

    D: Dim
    Inner: Dim
    T: Float
    approximate: str = "tanh"

    up: Linear["D, Inner, T"]
    down: Linear["Inner, D, T"]

    def forward(self, x: "Tensor[*S, D; T]") -> "Tensor[*S, D; T]":
        return self.down(ops.linear_gelu(x, self.up.weight, self.up.bias, self.approximate))


class Attention(transformer.SelfAttention):
    """Multi-head self-attention with separate query, key and value projections."""

    def last_query(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, 1, D; T]":
        """``forward(x)[:, -1:]``: the last token's output alone, every token still a key and a value."""
        return transformer.attend(self, x, -1)


class EncoderLayer(transformer.MultiHead):
    """Pre-norm transformer layer: attention then the MLP, each with a residual."""

    Inner: Dim
    T: Float

    norm1: LayerNorm["D, T"]
    attention: Attention["D, Heads, T"]
    norm2: LayerNorm["D, T"]
    mlp: Mlp["D, Inner, T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, N, D; T]":
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def last_token(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, D; T]":
        """``forward(x)[:, -1]``, the rest of the tokens left out after the attention."""
        x = x[:, -1:] + self.attention.last_query(self.norm1(x))
        return (x + self.mlp(self.norm2(x)))[:, 0]


class AttentionPool(transformer.MultiHead):
    """Multihead attention pooling: a learnt probe attends over the tokens, then a residual MLP.

    The attention is ``torch.nn.MultiheadAttention``'s: one packed input projection (query rows
    first, then key, then value) and an output projection.
    """

    Inner: Dim
    T: Float

    probe: Param["1, 1, D; T"]
    in_proj_weight: Param["3 * D, D; T"]
    in_proj_bias: Param["3 * D; T"]
    out: Linear["D, D, T"]
    norm: LayerNorm["D, T"]
    mlp: Mlp["D, Inner, T"]

    def forward(self, x: "Tensor[B, N, D; T]") -> "Tensor[B, D; T]":
        B, D = x.shape[0], self.D
        w, b = self.in_proj_weight, self.in_proj_bias
        q, k, v = (w[:D], b[:D]), (w[D:2 * D], b[D:2 * D]), (w[2 * D:], b[2 * D:])  # the packed input projection
        projections = [q, k, v, (self.out.weight, self.out.bias)]
        y = ops.projected_attention(self.probe.expand(B, -1, -1), x, x, self.Heads, projections)
        y = y + self.mlp(self.norm(y))
        return y[:, 0]


class Model(Block):
    """Both towers; ``similarity`` gives one logit per (text, image) pair."""

    Height: Dim
    Width: Dim
    Channels: Dim
    Patch: Dim
    VisionD: Dim
    VisionHeads: Dim
    VisionInner: Dim
    VisionLayers: Dim
    Vocab: Dim
    MaxPositions: Dim
    TextD: Dim
    TextHeads: Dim
    TextInner: Dim
    TextLayers: Dim
    T: Float = f32
    where = ("Patch > 0, VisionHeads > 0, VisionD % VisionHeads == 0, TextHeads > 0, TextD % TextHeads == 0, "
             "MaxPositions > 0, TextD == VisionD, Height >= Patch, Width >= Patch, VisionD > 0, Channels > 0, "
             "TextLayers > 0")  # text_features runs the last text layer for the last token alone
    imports = ("std.nn.embedding", "std.nn.linear", "std.nn.norm")

    patch_weight: Param["VisionD, Channels, Patch, Patch; T"]
    patch_bias: Param["VisionD; T"]
    vision_positions: Param["(Height / Patch) * (Width / Patch), VisionD; T"]
    vision_layers: Array[EncoderLayer["VisionD, VisionHeads, VisionInner, T"], "VisionLayers"]
    vision_post_norm: LayerNorm["VisionD, T"]
    vision_head: AttentionPool["VisionD, VisionHeads, VisionInner, T"]
    token_embedding: Param["Vocab, TextD; T"]
    text_positions: Param["MaxPositions, TextD; T"]
    text_layers: Array[EncoderLayer["TextD, TextHeads, TextInner, T"], "TextLayers"]
    text_final_norm: LayerNorm["TextD, T"]
    text_head: Linear["TextD, TextD, T"]
    logit_scale: Param["1; T"]
    logit_bias: Param["1; T"]

    @entry
    def image_features(self, image: "Tensor[B, Channels, Height, Width; T]") -> "Tensor[B, VisionD; T]":
        """The pooled image embedding (not normalised)."""
        x = self._embed(image)
        for layer in self.vision_layers:
            x = layer(x)
        return self.vision_head(self.vision_post_norm(x))

    @entry
    def text_features(self, tokens: "Tensor[B, MaxPositions; i32]") -> "Tensor[B, TextD; T]":
        """The text embedding (not normalised): the head applied to the last token. The last layer runs
        its query, projections and MLP for that token alone (every token is still its keys and values)."""
        x = ops.embedding(tokens, self.token_embedding) + self.text_positions
        for layer in self.text_layers[:-1]:
            x = layer(x)
        return self.text_head(self.text_final_norm(self.text_layers[-1].last_token(x)))

    @entry
    def similarity(
        self, image: "Tensor[Bi, Channels, Height, Width; T]", tokens: "Tensor[Bt, MaxPositions; i32]"
    ) -> "Tensor[Bt, Bi; T]":
        """Logits per text: one row per text, one column per image."""
        image_embeds = ops.l2_normalize(self.image_features(image))
        text_embeds = ops.l2_normalize(self.text_features(tokens))
        logits = ops.matmul(text_embeds, image_embeds.transpose(0, 1))
        return logits * ops.exp(self.logit_scale) + self.logit_bias

    @entry
    def logits_per_image(
        self, image: "Tensor[Bi, Channels, Height, Width; T]", tokens: "Tensor[Bt, MaxPositions; i32]"
    ) -> "Tensor[Bi, Bt; T]":
        """Logits per image: one row per image, one column per text (``similarity`` transposed)."""
        return self.similarity(image, tokens).transpose(0, 1)

    @entry
    def probabilities(
        self, image: "Tensor[Bi, Channels, Height, Width; T]", tokens: "Tensor[Bt, MaxPositions; i32]"
    ) -> "Tensor[Bi, Bt; T]":
        """The sigmoid of ``logits_per_image``: for each image, how likely each text describes it."""
        return ops.sigmoid(self.logits_per_image(image, tokens))

    def _embed(
        self, image: "Tensor[B, Channels, Height, Width; T]"
    ) -> "Tensor[B, (Height / Patch) * (Width / Patch), VisionD; T]":
        x = ops.conv2d(image, self.patch_weight, self.patch_bias, stride=self.Patch)
        return x.flatten(2).transpose(1, 2).contiguous() + self.vision_positions
