//! With the `c10d` feature: compiles `shim/c10d.cpp` against the libtorch of PyTorch's wheel and
//! Debian's gloo headers, and links libtorch_cpu. With `nccl` as well: NCCL's process group too,
//! against the CUDA runtime's and NCCL's headers, linking libtorch_cuda. Without either, nothing.
//!
//! libtorch is found as tch finds it: `LIBTORCH` (a libtorch directory), else the `torch` package
//! of `python3` on PATH (`LIBTORCH_USE_PYTORCH=1` is what tch needs for the same). gloo's headers
//! are not in the wheel: `GLOO_INCLUDE`, else `/usr/include` (Debian's `libgloo-dev`). CUDA's and
//! NCCL's headers: `CUDA_INCLUDE` (directories joined by `:`), else the `include` directory of
//! each `nvidia/*` package beside the wheel's torch (PyPI's CUDA build installs them) and
//! `$CUDA_HOME/include` (default `/usr/local/cuda`) where it exists.

fn main() {
    println!("cargo:rerun-if-changed=shim/c10d.cpp");
    #[cfg(feature = "c10d")]
    shim();
}

#[cfg(feature = "c10d")]
fn shim() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=GLOO_INCLUDE");
    println!("cargo:rerun-if-env-changed=CUDA_INCLUDE");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    // Which python3 (so which torch) is found.
    println!("cargo:rerun-if-env-changed=PATH");
    let (torch, abi) =
        libtorch().unwrap_or_else(|e| panic!("the c10d feature needs libtorch: {e}"));
    let gloo = std::env::var("GLOO_INCLUDE").unwrap_or_else(|_| "/usr/include".into());
    if !std::path::Path::new(&gloo).join("gloo/config.h").exists() {
        panic!(
            "the c10d feature needs gloo's headers, which PyTorch's wheel lacks: install Debian's \
             libgloo-dev, or set GLOO_INCLUDE to the directory holding gloo/"
        );
    }
    let include = torch.join("include");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .file("shim/c10d.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(&gloo)
        .define("USE_C10D_GLOO", None);
    let mut libs = vec!["torch_cpu", "c10"];
    if cfg!(feature = "nccl") {
        let cuda = cuda_includes(&torch);
        let has = |header: &str| cuda.iter().any(|d| d.join(header).exists());
        if ![
            "nccl.h",
            "cuda_runtime_api.h",
            "crt/host_config.h",
            "nv/target",
        ]
        .into_iter()
        .all(has)
        {
            panic!(
                "the nccl feature needs NCCL's and CUDA's headers: a CUDA build of PyTorch's \
                 wheel brings NCCL's and the runtime's (nvidia-nccl-*, nvidia-cuda-runtime-*); \
                 add the compiler's and libcu++'s (pip install nvidia-cuda-nvcc-cu12 \
                 nvidia-cuda-cccl-cu12 of the wheel's CUDA version), or point CUDA_INCLUDE at a \
                 CUDA toolkit's (looked in {cuda:?})"
            );
        }
        build
            .includes(&cuda)
            .define("USE_C10D_NCCL", None)
            .define("USE_CUDA", None)
            .define("K3MINI_NCCL", None);
        libs.extend(["torch_cuda", "c10_cuda"]);
    }
    build
        // Debian's gloo headers are older than the gloo inside the wheel (no
        // GLOO_STORE_HAS_STORE_V2): the shim only calls torch's code and never makes gloo's
        // types itself, so no layout of the two is mixed.
        .define("_GLIBCXX_USE_CXX11_ABI", abi)
        // libtorch's headers warn by the hundred; the shim's own code is small.
        .flag("-w")
        .compile("k3mini_c10d");
    let lib = torch.join("lib");
    println!("cargo:rustc-link-search=native={}", lib.display());
    for l in libs {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    // This package's tests find libtorch without LD_LIBRARY_PATH (a crate that depends on this
    // one sets its own, as tch's users do).
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}

/// The libtorch directory (holding include/ and lib/) and the C++ ABI it was built with (`1` or
/// `0`, for `_GLIBCXX_USE_CXX11_ABI`).
#[cfg(feature = "c10d")]
fn libtorch() -> Result<(std::path::PathBuf, &'static str), String> {
    if let Some(dir) = std::env::var_os("LIBTORCH") {
        // libtorch's own archives of recent releases are built with the new ABI.
        return Ok((dir.into(), "1"));
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import os, torch; print(os.path.dirname(torch.__file__)); \
             print(int(torch._C._GLIBCXX_USE_CXX11_ABI))",
        ])
        .output()
        .map_err(|e| format!("set LIBTORCH, or put a python3 with torch on PATH ({e})"))?;
    if !out.status.success() {
        return Err(format!(
            "set LIBTORCH, or put a python3 with torch on PATH (python3 says: {})",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    let (Some(dir), Some(abi)) = (lines.next(), lines.next()) else {
        return Err(format!(
            "python3 printed {text:?}, not torch's directory and ABI"
        ));
    };
    Ok((dir.trim().into(), if abi.trim() == "1" { "1" } else { "0" }))
}

/// Where CUDA's and NCCL's headers are ([`shim`]'s doc): `CUDA_INCLUDE`, else the wheel's
/// `nvidia/*/include` beside `torch` and the CUDA toolkit's.
#[cfg(feature = "c10d")]
fn cuda_includes(torch: &std::path::Path) -> Vec<std::path::PathBuf> {
    if let Ok(dirs) = std::env::var("CUDA_INCLUDE") {
        return std::env::split_paths(&dirs).collect();
    }
    let mut dirs: Vec<std::path::PathBuf> = torch
        .parent()
        .map(|site| site.join("nvidia"))
        .and_then(|nvidia| std::fs::read_dir(nvidia).ok())
        .into_iter()
        .flatten()
        .filter_map(|e| Some(e.ok()?.path().join("include")))
        .filter(|d| d.is_dir())
        .collect();
    dirs.sort();
    let home = std::env::var("CUDA_HOME").unwrap_or_else(|_| "/usr/local/cuda".into());
    dirs.extend(Some(std::path::Path::new(&home).join("include")).filter(|d| d.is_dir()));
    dirs
}
