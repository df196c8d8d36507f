//! moelink's CUDA C++ kernel sources (placeholder; being implemented).
