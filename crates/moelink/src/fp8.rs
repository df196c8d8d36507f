//! FP8 E4M3 conversion and the per-128-channel quantiser. (Being implemented: see the FP8/LL work item.)
