//! With the `c10d` feature: compiles `shim/c10d.cpp` against the libtorch of PyTorch's wheel and
//! Debian's gloo headers, and links libtorch_cpu. Without it, nothing.
//!
//! libtorch is found as tch finds it: `LIBTORCH` (a libtorch directory), else the `torch` package
//! of `python3` on PATH (`LIBTORCH_USE_PYTORCH=1` is what tch needs for the same). gloo's headers
//! are not in the wheel: `GLOO_INCLUDE`, else `/usr/include` (Debian's `libgloo-dev`).

fn main() {
    println!("cargo:rerun-if-changed=shim/c10d.cpp");
    #[cfg(feature = "c10d")]
    shim();
}

#[cfg(feature = "c10d")]
fn shim() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=GLOO_INCLUDE");
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
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("shim/c10d.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(&gloo)
        .define("USE_C10D_GLOO", None)
        // Debian's gloo headers are older than the gloo inside the wheel (no
        // GLOO_STORE_HAS_STORE_V2): the shim only calls torch's code and never makes gloo's
        // types itself, so no layout of the two is mixed.
        .define("_GLIBCXX_USE_CXX11_ABI", abi)
        // libtorch's headers warn by the hundred; the shim's own code is small.
        .flag("-w")
        .compile("k3mini_c10d");
    let lib = torch.join("lib");
    println!("cargo:rustc-link-search=native={}", lib.display());
    for l in ["torch_cpu", "c10"] {
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
