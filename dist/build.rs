//! With the `c10d` feature: compiles `shim/c10d.cpp` against the libtorch of PyTorch's wheel and
//! Debian's gloo headers, and links libtorch_cpu. Without it, nothing.
//!
//! libtorch is found as tch finds it: `LIBTORCH` (a libtorch directory), else the `torch` package
//! of `python3` on PATH (`LIBTORCH_USE_PYTORCH=1` is what tch needs for the same). gloo's headers
//! are not in the wheel: `GLOO_INCLUDE`, else `/usr/include` (Debian's `libgloo-dev`).

fn main() {
    println!("cargo:rerun-if-changed=shim/c10d.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=GLOO_INCLUDE");
    #[cfg(feature = "c10d")]
    shim();
}

#[cfg(feature = "c10d")]
fn shim() {
    let torch = libtorch().unwrap_or_else(|e| panic!("the c10d feature needs libtorch: {e}"));
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
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        // libtorch's headers warn by the hundred; the shim's own code is small.
        .flag("-w")
        .compile("k3mini_c10d");
    let lib = torch.join("lib");
    println!("cargo:rustc-link-search=native={}", lib.display());
    for l in ["torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    // This package's tests find libtorch without LD_LIBRARY_PATH.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}

/// The libtorch directory (holding include/ and lib/).
#[cfg(feature = "c10d")]
fn libtorch() -> Result<std::path::PathBuf, String> {
    if let Some(dir) = std::env::var_os("LIBTORCH") {
        return Ok(dir.into());
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import os, torch; print(os.path.dirname(torch.__file__))",
        ])
        .output()
        .map_err(|e| format!("set LIBTORCH, or put a python3 with torch on PATH ({e})"))?;
    if !out.status.success() {
        return Err(format!(
            "set LIBTORCH, or put a python3 with torch on PATH (python3 says: {})",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok(dir.into())
}
