//! Element types moelink moves, and the host-side element trait.

use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// One byte per element, 0 or 1 (torch.bool).
    Bool,
    U8,
    I32,
    I64,
    F32,
    BF16,
    /// OCP FP8 E4M3 ("fn": no infinities, one NaN pattern, max finite 448), torch.float8_e4m3fn.
    Fp8E4M3,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::Fp8E4M3 => 1,
            DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 => 8,
        }
    }

    /// The torch name of the type, used in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::Fp8E4M3 => "float8_e4m3fn",
        }
    }

    /// Parse a torch-style name (`"bfloat16"`, `"torch.float32"`, ...).
    pub fn from_name(name: &str) -> Option<DType> {
        let n = name.strip_prefix("torch.").unwrap_or(name);
        Some(match n {
            "bool" => DType::Bool,
            "uint8" => DType::U8,
            "int32" => DType::I32,
            "int64" => DType::I64,
            "float32" | "float" => DType::F32,
            "bfloat16" => DType::BF16,
            "float8_e4m3fn" => DType::Fp8E4M3,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One FP8 E4M3 value as its raw byte. Conversions live in [`crate::fp8`].
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Fp8E4M3(pub u8);

/// A plain-old-data element type with a [`DType`].
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    const DTYPE: DType;
}

impl Element for u8 {
    const DTYPE: DType = DType::U8;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for Fp8E4M3 {
    const DTYPE: DType = DType::Fp8E4M3;
}
