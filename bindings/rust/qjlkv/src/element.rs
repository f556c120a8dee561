use std::fmt;

use qjlkv_sys as sys;

/// Element type of keys, values, queries and outputs (`qjlkv_dtype`). Computation is fp32.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `f32`.
    F32,
    /// IEEE binary16, passed as [`F16`].
    F16,
    /// bfloat16, passed as [`Bf16`].
    Bf16,
}

impl Dtype {
    pub(crate) fn to_raw(self) -> sys::qjlkv_dtype {
        match self {
            Dtype::F32 => sys::QJLKV_DTYPE_F32,
            Dtype::F16 => sys::QJLKV_DTYPE_F16,
            Dtype::Bf16 => sys::QJLKV_DTYPE_BF16,
        }
    }

    pub(crate) fn from_raw(raw: sys::qjlkv_dtype) -> Option<Dtype> {
        match raw {
            sys::QJLKV_DTYPE_F32 => Some(Dtype::F32),
            sys::QJLKV_DTYPE_F16 => Some(Dtype::F16),
            sys::QJLKV_DTYPE_BF16 => Some(Dtype::Bf16),
            _ => None,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        })
    }
}

/// An IEEE binary16 number as its bit pattern (layout-compatible with `u16` and with the
/// `f16` of other crates, so their slices can be reinterpreted).
///
/// ```
/// use qjlkv::F16;
/// assert_eq!(F16::from_f32(1.0), F16(0x3c00));
/// assert_eq!(F16::from_f32(0.1).to_f32(), 0.099975586);
/// assert_eq!(F16::from_f32(1e6).to_f32(), f32::INFINITY);
/// ```
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct F16(pub u16);

/// A bfloat16 number as its bit pattern (layout-compatible with `u16`).
///
/// ```
/// use qjlkv::Bf16;
/// assert_eq!(Bf16::from_f32(1.0), Bf16(0x3f80));
/// assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0), Bf16(0x3f80)); // a tie rounds to even
/// assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
/// ```
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Bf16(pub u16);

impl F16 {
    /// Rounds to the nearest binary16 (ties to even); overflow gives ±infinity.
    pub fn from_f32(x: f32) -> F16 {
        let bits = x.to_bits();
        let sign = ((bits >> 16) & 0x8000) as u16;
        let exponent = ((bits >> 23) & 0xff) as i32;
        let mantissa = bits & 0x7f_ffff;
        if exponent == 0xff {
            // Infinity stays infinity; NaN stays a (quiet) NaN.
            let nan = if mantissa != 0 {
                0x200 | (mantissa >> 13) as u16
            } else {
                0
            };
            return F16(sign | 0x7c00 | nan);
        }
        let half_exponent = exponent - 127 + 15;
        if half_exponent >= 0x1f {
            return F16(sign | 0x7c00);
        }
        if half_exponent <= 0 {
            // Subnormal result: value = m * 2^-24 with m = significand >> (14 - e).
            if half_exponent < -10 {
                return F16(sign); // below half of the smallest subnormal
            }
            let significand = mantissa | 0x80_0000;
            let shift = (14 - half_exponent) as u32;
            return F16(sign | round_shift(significand, shift) as u16);
        }
        // A carry out of the mantissa correctly bumps the exponent (up to infinity).
        let truncated = ((half_exponent as u32) << 10) | (mantissa >> 13);
        let rounded = round_tail(truncated, mantissa & 0x1fff, 0x1000);
        F16(sign | rounded as u16)
    }

    /// The exact `f32` value.
    pub fn to_f32(self) -> f32 {
        let sign = u32::from(self.0 & 0x8000) << 16;
        let exponent = u32::from((self.0 >> 10) & 0x1f);
        let mantissa = u32::from(self.0 & 0x3ff);
        let magnitude_bits = match exponent {
            0 => {
                // Subnormal: mantissa * 2^-24, exact in f32.
                let magnitude = mantissa as f32 * f32::from_bits(0x3380_0000);
                return if sign != 0 { -magnitude } else { magnitude };
            }
            0x1f => 0x7f80_0000 | (mantissa << 13),
            _ => ((exponent + 112) << 23) | (mantissa << 13),
        };
        f32::from_bits(sign | magnitude_bits)
    }
}

impl Bf16 {
    /// Rounds to the nearest bfloat16 (ties to even); NaN stays NaN.
    pub fn from_f32(x: f32) -> Bf16 {
        let bits = x.to_bits();
        if x.is_nan() {
            return Bf16(((bits >> 16) | 0x40) as u16);
        }
        Bf16((round_tail(bits >> 16, bits & 0xffff, 0x8000)) as u16)
    }

    /// The exact `f32` value.
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

/// Rounds `truncated` up when the dropped `tail` is above `half`, or equal and `truncated` odd.
fn round_tail(truncated: u32, tail: u32, half: u32) -> u32 {
    if tail > half || (tail == half && truncated & 1 == 1) {
        truncated + 1
    } else {
        truncated
    }
}

/// `value >> shift`, rounded to nearest even.
fn round_shift(value: u32, shift: u32) -> u32 {
    round_tail(value >> shift, value & ((1 << shift) - 1), 1 << (shift - 1))
}

impl From<F16> for f32 {
    fn from(x: F16) -> f32 {
        x.to_f32()
    }
}

impl From<Bf16> for f32 {
    fn from(x: Bf16) -> f32 {
        x.to_f32()
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for super::F16 {}
    impl Sealed for super::Bf16 {}
}

/// An element type the cache accepts: `f32`, [`F16`] or [`Bf16`]. A slice of `T` must match
/// the cache's [`Dtype`]; a mismatch is an error, never a reinterpretation.
pub trait Element: sealed::Sealed + Copy + Default + Send + Sync + 'static {
    /// The dtype a cache needs for slices of this type.
    const DTYPE: Dtype;
    /// The value as `f32` (exact).
    fn to_f32(self) -> f32;
    /// The nearest value of this type (ties to even).
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> f32 {
        x
    }
}

impl Element for F16 {
    const DTYPE: Dtype = Dtype::F16;
    fn to_f32(self) -> f32 {
        F16::to_f32(self)
    }
    fn from_f32(x: f32) -> F16 {
        F16::from_f32(x)
    }
}

impl Element for Bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
    fn to_f32(self) -> f32 {
        Bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Bf16 {
        Bf16::from_f32(x)
    }
}
