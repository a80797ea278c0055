"""Codec helpers (fp8mla.fp8_e4m3_*, bf16_*, encode/decode_tokens) against the definitions."""

import numpy as np
import pytest

import fp8mla
import mla_ref as ref


def test_e4m3_decode_all_codes():
    got = fp8mla.fp8_e4m3_decode(np.arange(256, dtype=np.uint8))
    ref.assert_close(got, ref.E4M3, 0.0, 0.0, "e4m3 decode")
    assert np.isnan(got[0x7F]) and np.isnan(got[0xFF])
    assert got[0x7E] == 448.0 and got[0x01] == 2.0**-9
    assert np.signbit(got[0x80]) and got[0x80] == 0.0


def test_e4m3_encode_round_trip_every_code():
    finite = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=np.uint8)
    vals = ref.E4M3[finite].astype(np.float32)
    assert np.array_equal(fp8mla.fp8_e4m3_encode(vals), finite)


def test_e4m3_encode_ties_and_random(rng):
    # Every midpoint between neighbouring codes is a tie: it must go to the even code.
    pos = ref.E4M3[:127]
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    assert np.all(mids.astype(np.float64) == (pos[:-1] + pos[1:]) / 2)  # exact in float32
    ties = np.concatenate([mids, -mids])
    assert np.array_equal(fp8mla.fp8_e4m3_encode(ties), ref.e4m3_encode(ties))
    x = (rng.standard_normal(20000) * rng.choice([1e-3, 0.1, 1, 30, 300], 20000)).astype(np.float32)
    assert np.array_equal(fp8mla.fp8_e4m3_encode(x), ref.e4m3_encode(x))


def test_e4m3_encode_saturates_and_specials():
    x = np.array([448.0, 449.0, 464.0, 1e9, np.inf, -np.inf, -500.0, 0.0, -0.0, np.nan, -np.nan],
                 dtype=np.float32)
    got = fp8mla.fp8_e4m3_encode(x)
    assert list(got[:7]) == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]
    assert got[7] == 0x00 and got[8] == 0x80
    assert got[9] & 0x7F == 0x7F and got[10] & 0x7F == 0x7F


def test_e4m3_decode_accepts_shapes():
    codes = np.arange(256, dtype=np.uint8).reshape(4, 8, 8)
    assert fp8mla.fp8_e4m3_decode(codes).shape == (4, 8, 8)
    with pytest.raises(ValueError):
        fp8mla.fp8_e4m3_decode(np.zeros(4, dtype=np.float32))


def test_bf16_codec(rng):
    x = (rng.standard_normal(50000) * 10.0 ** rng.integers(-30, 30, 50000)).astype(np.float32)
    x[:4] = [np.inf, -np.inf, 0.0, -0.0]
    assert np.array_equal(fp8mla.bf16_encode(x), ref.f32_to_bf16(x))
    bits = rng.integers(0, 2**16, 10000, dtype=np.uint16)
    bits = bits[(bits & 0x7F80) != 0x7F80]  # finite
    assert np.array_equal(fp8mla.bf16_decode(bits).astype(np.float64), ref.bf16_to_f64(bits))
    nan_bits = fp8mla.bf16_encode(np.array([np.nan], dtype=np.float32))
    assert np.isnan(fp8mla.bf16_decode(nan_bits))[0]


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_token_round_trip_bound(rng, fmt):
    scale = 0.25 if fmt == "fp8_e4m3" else 1.0
    vals = ref.random_tokens(rng, (64,), fmt, scale)
    data = fp8mla.encode_tokens(vals, fmt, scale)
    assert data.shape == (64, ref.TOKEN_BYTES[fmt]) and data.dtype == np.uint8
    assert fp8mla.token_bytes(fmt) == ref.TOKEN_BYTES[fmt]
    back = fp8mla.decode_tokens(data, fmt, scale)
    # The library decodes exactly what the reference decoder reads from the bytes.
    ref.assert_close(back, ref.decode_tokens(data, fmt, scale), 0.0, 0.0, f"{fmt} decode")
    # Round-trip error: half an ulp, 2^-8 relative for bf16 (8-bit significand), 2^-4 for e4m3
    # (4-bit significand), plus half the subnormal step 2^-10 (times the scale) for e4m3.
    rel = {"bf16": 2.0**-8, "fp8_e4m3": 2.0**-4, "fp8_e4m3_block": 2.0**-4}[fmt]
    err = np.abs(back - vals)
    if fmt == "fp8_e4m3_block":
        ckv_scales = data[:, 512:528].copy().view("<f4")
        sub = np.repeat(ckv_scales, 128, axis=1) * 2.0**-10
        bound = np.concatenate(
            [rel * np.abs(vals[:, :512]) + sub, 2.0**-8 * np.abs(vals[:, 512:])], axis=1)
    else:
        sub = scale * 2.0**-10 if fmt == "fp8_e4m3" else 0.0
        bound = rel * np.abs(vals) + sub
    assert np.all(err <= bound * (1 + 1e-6))
    # Single-token helpers agree with the batched ones.
    assert np.array_equal(fp8mla.encode_token(vals[0], fmt, scale), data[0])
    assert np.array_equal(fp8mla.decode_token(data[0], fmt, scale), back[0])


def test_block_format_bytes_match_the_writer(rng):
    vals = ref.random_tokens(rng, (16,), "fp8_e4m3_block")
    vals[3, :128] *= 1000.0  # a large group
    vals[5, 128:256] = 0.0  # an all-zero group: scale 2^ceil(log2(1e-4))
    vals[7, 256:384] *= 1e-6
    got = fp8mla.encode_tokens(vals, "fp8_e4m3_block")
    assert np.array_equal(got, ref.encode_block_token(vals))
    scales = got[:, 512:528].copy().view("<f4")
    assert np.all(np.log2(scales) == np.round(np.log2(scales)))  # powers of two


def test_encode_nan_policy():
    vals = np.zeros((3, 576), dtype=np.float32)
    vals[1, 17] = np.nan
    with pytest.raises(ValueError, match="values"):
        fp8mla.encode_tokens(vals, "fp8_e4m3", nan="error")
    data = fp8mla.encode_tokens(vals, "fp8_e4m3", nan="propagate")
    assert data[1, 17] & 0x7F == 0x7F
    with pytest.raises(ValueError, match="nan"):
        fp8mla.encode_tokens(vals, "fp8_e4m3", nan="ignore")


def test_format_names():
    assert fp8mla.as_format("fp8") == fp8mla.KvFormat.fp8_e4m3
    assert fp8mla.as_format("fp8_e4m3_block") == fp8mla.KvFormat.fp8_e4m3_block
    assert fp8mla.as_format(fp8mla.KvFormat.bf16) == fp8mla.KvFormat.bf16
    with pytest.raises(ValueError):
        fp8mla.as_format("int4")
    with pytest.raises(ValueError, match="scale"):
        fp8mla.encode_tokens(np.zeros(576, np.float32), "fp8_e4m3", scale=0.0)
