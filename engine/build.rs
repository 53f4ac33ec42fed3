//! Under the `cuda` feature, compiles the engine's CUDA kernels (`src/model/kernels/*.cu`) to PTX
//! with the toolkit's nvcc, for `CUDA_COMPUTE_CAP` (default 90: H100/H200); the driver compiles
//! the PTX for the GPU it loads on. Without the feature there is nothing to build.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=src/model/kernels");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|home| PathBuf::from(home).join("bin/nvcc"))
        .filter(|nvcc| nvcc.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let source = "src/model/kernels/paged_attention.cu";
    let status = Command::new(&nvcc)
        .args([
            "--ptx",
            "-O3",
            "-std=c++17",
            &format!("--gpu-architecture=compute_{cap}"),
        ])
        .arg(source)
        .arg("-o")
        .arg(out.join("paged_attention.ptx"))
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "running {}: {e} (is the CUDA toolkit set up?)",
                nvcc.display()
            )
        });
    assert!(status.success(), "nvcc failed on {source}");
}
