//! Why GPU work cannot proceed.

/// A GPU-side failure, typed so the embedder can say what to check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuError {
    /// No `libcuda.so` could be loaded (no NVIDIA driver on this host).
    NoLibcuda,
    /// The driver loaded but reports no device.
    NoDevice,
    /// A CUDA driver call failed.
    Driver(String),
    /// No NVRTC library (`libnvrtc.so`) to compile kernels with.
    NoNvrtc,
    /// NVRTC refused a kernel's source.
    Compile(String),
    /// A copy reached outside a device region.
    OutOfRange {
        /// Start of the copy in the region.
        offset: usize,
        /// Its length.
        len: usize,
        /// The region's size.
        size: usize,
    },
    /// The waiter thread is gone (the node shut down).
    Stopped,
}

impl std::fmt::Display for GpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuError::NoLibcuda => write!(
                f,
                "no CUDA driver library (libcuda.so) on this host: install the NVIDIA driver, or run without --gpu"
            ),
            GpuError::NoDevice => write!(f, "the CUDA driver reports no GPU: run without --gpu"),
            GpuError::Driver(e) => write!(f, "CUDA driver error: {e}"),
            GpuError::NoNvrtc => write!(
                f,
                "no NVRTC library (libnvrtc.so) to compile the demo's kernels: install the CUDA toolkit's nvrtc (e.g. cuda-nvrtc-12-x), or run without --gpu"
            ),
            GpuError::Compile(e) => write!(f, "NVRTC could not compile a kernel: {e}"),
            GpuError::OutOfRange { offset, len, size } => write!(
                f,
                "a copy of {len} bytes at {offset} reaches outside a {size}-byte device region"
            ),
            GpuError::Stopped => write!(f, "the GPU event waiter has stopped"),
        }
    }
}

impl std::error::Error for GpuError {}
