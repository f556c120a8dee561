//! Finds libqjlkv and tells rustc how to link it. The first that applies wins:
//!
//! 1. `QJLKV_LIB_DIR` (with optional `QJLKV_INCLUDE_DIR`): a directory holding
//!    `libqjlkv.so` (linked dynamically) or `libqjlkv.a` (linked statically);
//!    `QJLKV_STATIC=1` prefers the static archive when both are there.
//! 2. `QJLKV_BUILD_DIR`: an existing CMake build directory of this repository holding
//!    `libqjlkv.a` (target `qjlkv_static`), linked statically, so CI builds the library once.
//! 3. In-tree (this crate inside the libqjlkv repository, `../../../CMakeLists.txt`):
//!    builds the `qjlkv_static` target with CMake into `OUT_DIR` (CPU only, Release) and
//!    links it statically. In-tree comes before pkg-config so that the tests exercise the
//!    sources next to them, not an older installed copy. `QJLKV_USE_PKG_CONFIG=1` skips it.
//! 4. `pkg-config qjlkv` (the binary, no crate); `QJLKV_STATIC=1` links statically.
//!
//! Anything else fails the build with instructions.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// How the library was found: where it lives and how to link it.
struct Found {
    lib_dirs: Vec<PathBuf>,
    include_dir: Option<PathBuf>,
    static_link: bool,
    /// Libraries besides qjlkv that the linker must see (pkg-config may list some).
    extra_libs: Vec<String>,
}

fn main() {
    for var in [
        "QJLKV_LIB_DIR",
        "QJLKV_INCLUDE_DIR",
        "QJLKV_BUILD_DIR",
        "QJLKV_STATIC",
        "QJLKV_USE_PKG_CONFIG",
        "PKG_CONFIG_PATH",
        "PKG_CONFIG",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");

    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let bindings_version = bindings_version(&manifest_dir.join("src/bindings.rs"));
    let mut attempts = Vec::new();

    let found = from_lib_dir()
        .or_else(from_build_dir)
        .or_else(|| from_source_tree(&manifest_dir, &mut attempts))
        .or_else(|| from_pkg_config(bindings_version, &mut attempts))
        .unwrap_or_else(|| fail_not_found(&attempts));

    if let Some(include_dir) = &found.include_dir {
        check_header_version(include_dir, bindings_version);
        // Exposed to dependents as DEP_QJLKV_INCLUDE.
        println!("cargo:include={}", include_dir.display());
    }
    emit_link_flags(&found);
}

fn env_path(var: &str) -> Option<PathBuf> {
    env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from)
}

fn env_flag(var: &str) -> bool {
    env::var(var).is_ok_and(|v| !v.is_empty() && v != "0")
}

fn from_lib_dir() -> Option<Found> {
    let dir = env_path("QJLKV_LIB_DIR")?;
    let shared = dir.join("libqjlkv.so").exists() || dir.join("libqjlkv.dylib").exists();
    let archive = dir.join("libqjlkv.a").exists();
    if !shared && !archive {
        panic!(
            "QJLKV_LIB_DIR={} holds neither libqjlkv.so nor libqjlkv.a; point it at the directory \
             that contains the built or installed library",
            dir.display()
        );
    }
    for lib in ["libqjlkv.so", "libqjlkv.dylib", "libqjlkv.a"] {
        if dir.join(lib).exists() {
            println!("cargo:rerun-if-changed={}", dir.join(lib).display());
        }
    }
    let include_dir = env_path("QJLKV_INCLUDE_DIR").or_else(|| {
        let guess = dir.join("../include");
        guess.join("qjlkv/qjlkv.h").exists().then_some(guess)
    });
    Some(Found {
        lib_dirs: vec![dir],
        include_dir,
        static_link: archive && (!shared || env_flag("QJLKV_STATIC")),
        extra_libs: Vec::new(),
    })
}

fn from_build_dir() -> Option<Found> {
    let dir = env_path("QJLKV_BUILD_DIR")?;
    let archive = dir.join("libqjlkv.a");
    if !archive.exists() {
        panic!(
            "QJLKV_BUILD_DIR={} has no libqjlkv.a; build it first with \
             `cmake --build {} --target qjlkv_static`",
            dir.display(),
            dir.display()
        );
    }
    // Relink when that build is refreshed.
    println!("cargo:rerun-if-changed={}", archive.display());
    let cache = fs::read_to_string(dir.join("CMakeCache.txt")).unwrap_or_default();
    let cached = |key: &str| {
        let prefix = format!("{key}:");
        cache.lines().find_map(|line| {
            line.strip_prefix(&prefix)?
                .split_once('=')
                .map(|(_, value)| value.to_owned())
        })
    };
    let mut found = Found {
        lib_dirs: vec![dir.clone()],
        include_dir: env_path("QJLKV_INCLUDE_DIR")
            .or_else(|| cached("CMAKE_HOME_DIRECTORY").map(|src| PathBuf::from(src).join("include"))),
        static_link: true,
        extra_libs: Vec::new(),
    };
    // A build with the CUDA backend links CUDA::cudart_static, found by FindCUDAToolkit
    // (which only runs for such builds); the archive needs it and its dependencies too.
    if let Some(cudart) = cached("CUDA_cudart_static_LIBRARY")
        .map(PathBuf::from)
        .filter(|p| p.exists())
    {
        found.lib_dirs.extend(cudart.parent().map(Path::to_path_buf));
        found
            .extra_libs
            .extend(["static=cudart_static", "dl", "rt"].map(String::from));
    }
    Some(found)
}

fn from_source_tree(manifest_dir: &Path, attempts: &mut Vec<String>) -> Option<Found> {
    let root = manifest_dir.join("../../..");
    if !root.join("CMakeLists.txt").exists() || !root.join("include/qjlkv/qjlkv.h").exists() {
        attempts.push("not inside the libqjlkv source tree (no ../../../CMakeLists.txt)".into());
        return None;
    }
    if env_flag("QJLKV_USE_PKG_CONFIG") {
        attempts.push("in-tree CMake build skipped: QJLKV_USE_PKG_CONFIG is set".into());
        return None;
    }
    for input in ["CMakeLists.txt", "cmake", "src", "include"] {
        println!("cargo:rerun-if-changed={}", root.join(input).display());
    }
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let build_dir = out_dir.join("cmake-build");
    let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "2".into());

    let mut configure = Command::new("cmake");
    configure.arg("-S").arg(&root).arg("-B").arg(&build_dir).args([
        "-DCMAKE_BUILD_TYPE=Release",
        "-DQJLKV_BUILD_TESTS=OFF",
        "-DQJLKV_BUILD_EXAMPLES=OFF",
        "-DQJLKV_BUILD_BENCH=OFF",
        "-DQJLKV_CUDA=OFF",
    ]);
    let mut build = Command::new("cmake");
    build
        .arg("--build")
        .arg(&build_dir)
        .args(["--target", "qjlkv_static", "--parallel", &jobs]);
    for (what, mut command) in [("configure", configure), ("build", build)] {
        match command.output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "building libqjlkv from the source tree failed at the CMake {what} step \
                 ({command:?}):\n{}\n{}\nFix the error above, or point QJLKV_LIB_DIR / \
                 QJLKV_BUILD_DIR at a built library.",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(err) => {
                attempts.push(format!("in-tree CMake build: could not run cmake ({err})"));
                return None;
            }
        }
    }
    if !build_dir.join("libqjlkv.a").exists() {
        panic!(
            "CMake built qjlkv_static but {} is missing",
            build_dir.join("libqjlkv.a").display()
        );
    }
    Some(Found {
        lib_dirs: vec![build_dir],
        include_dir: Some(root.join("include")),
        static_link: true,
        extra_libs: Vec::new(),
    })
}

fn from_pkg_config(bindings_version: (u32, u32), attempts: &mut Vec<String>) -> Option<Found> {
    let pkg_config = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".into());
    let static_link = env_flag("QJLKV_STATIC");
    let query = |args: &[&str]| -> Result<String, String> {
        let mut command = Command::new(&pkg_config);
        if static_link {
            command.arg("--static");
        }
        let out = command
            .args(args)
            .arg("qjlkv")
            .output()
            .map_err(|err| format!("could not run {pkg_config} ({err})"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
        }
    };
    let (libs, cflags, version) = match (query(&["--libs"]), query(&["--cflags"]), query(&["--modversion"])) {
        (Ok(libs), Ok(cflags), Ok(version)) => (libs, cflags, version),
        (Err(err), _, _) | (_, Err(err), _) | (_, _, Err(err)) => {
            attempts.push(format!("pkg-config qjlkv: {err}"));
            return None;
        }
    };
    let mut found = Found {
        lib_dirs: Vec::new(),
        include_dir: None,
        static_link,
        extra_libs: Vec::new(),
    };
    for flag in libs.split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-L") {
            found.lib_dirs.push(PathBuf::from(dir));
        } else if let Some(lib) = flag.strip_prefix("-l") {
            if lib != "qjlkv" {
                found.extra_libs.push(lib.to_owned());
            }
        }
    }
    found.include_dir = cflags
        .split_whitespace()
        .find_map(|f| f.strip_prefix("-I"))
        .map(PathBuf::from);
    check_version("pkg-config qjlkv --modversion", version.trim(), bindings_version);
    Some(found)
}

fn fail_not_found(attempts: &[String]) -> ! {
    panic!(
        "\n\nqjlkv-sys could not find libqjlkv. Tried:\n  - {}\n\nDo one of:\n  \
         - install libqjlkv so that `pkg-config --libs qjlkv` works (or set PKG_CONFIG_PATH);\n  \
         - set QJLKV_LIB_DIR to the directory holding libqjlkv.so or libqjlkv.a \
         (and QJLKV_INCLUDE_DIR to its include directory);\n  \
         - set QJLKV_BUILD_DIR to a CMake build directory of libqjlkv holding libqjlkv.a;\n  \
         - build inside the libqjlkv repository with cmake and a C++20 compiler installed.\n",
        attempts.join("\n  - ")
    );
}

fn emit_link_flags(found: &Found) {
    for dir in &found.lib_dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    if found.static_link {
        println!("cargo:rustc-link-lib=static=qjlkv");
    } else {
        println!("cargo:rustc-link-lib=dylib=qjlkv");
    }
    for lib in &found.extra_libs {
        println!("cargo:rustc-link-lib={lib}");
    }
    if found.static_link {
        // The archive is C++ and uses threads; its dependencies come after it.
        let cxx = if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
            "c++"
        } else {
            "stdc++"
        };
        for lib in [cxx, "pthread"] {
            if !found.extra_libs.iter().any(|l| l == lib) {
                println!("cargo:rustc-link-lib=dylib={lib}");
            }
        }
    }
}

/// (MAJOR, MINOR) of the header the committed bindings were generated from.
fn bindings_version(bindings: &Path) -> (u32, u32) {
    let text = fs::read_to_string(bindings).expect("src/bindings.rs is readable");
    let constant = |name: &str| -> u32 {
        let prefix = format!("pub const {name}: u32 = ");
        text.lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .and_then(|rest| rest.trim_end_matches(';').parse().ok())
            .unwrap_or_else(|| panic!("src/bindings.rs lacks {name}"))
    };
    (constant("QJLKV_VERSION_MAJOR"), constant("QJLKV_VERSION_MINOR"))
}

/// The bindings describe one ABI: a header of another MAJOR.MINOR means they may not fit.
fn check_header_version(include_dir: &Path, bindings_version: (u32, u32)) {
    let header = include_dir.join("qjlkv/qjlkv.h");
    let Ok(text) = fs::read_to_string(&header) else {
        println!(
            "cargo:warning=qjlkv-sys: {} not readable; header version not checked",
            header.display()
        );
        return;
    };
    let define = |name: &str| {
        let prefix = format!("#define {name} ");
        text.lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .map(|v| v.trim().to_owned())
    };
    if let (Some(major), Some(minor)) = (define("QJLKV_VERSION_MAJOR"), define("QJLKV_VERSION_MINOR")) {
        check_version(
            &header.display().to_string(),
            &format!("{major}.{minor}"),
            bindings_version,
        );
    }
}

fn check_version(source: &str, version: &str, (major, minor): (u32, u32)) {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    let found = (parts.next().flatten(), parts.next().flatten());
    if found != (Some(major), Some(minor)) {
        panic!(
            "{source} says libqjlkv {version}, but qjlkv-sys was generated for {major}.{minor}; \
             use a matching library or regenerate the bindings with qjlkv-sys/regen.sh"
        );
    }
}
