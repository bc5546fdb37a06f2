//! Finds UCX, generates the `ucp` bindings and builds the C shim.
//!
//! Discovery ladder, first match wins:
//! 1. `UCX_PREFIX` (headers in `$UCX_PREFIX/include`, libraries in `$UCX_PREFIX/lib`), or both
//!    `UCX_INCLUDE_DIR` and `UCX_LIB_DIR`;
//! 2. pkg-config's `ucx`, within the supported version range;
//! 3. the folder `scripts/provision` assembled (`KVX_PROVISIONED_UCX`, set by `.cargo/config.toml`);
//! 4. a failure that says how to install UCX.

use std::env;
use std::path::{Path, PathBuf};

/// Oldest UCX whose `ucp` API has everything the engine uses (`ucp_*_nbx`, active messages v2).
const MIN_VERSION: &str = "1.16";
/// First UCX major version we do not claim to support.
const MAX_VERSION: &str = "2.0";

struct Ucx {
    include_dir: PathBuf,
    lib_dir: PathBuf,
    how: String,
}

fn var(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

fn fail(msg: &str) -> ! {
    eprintln!("ucx-sys: {msg}");
    panic!("ucx-sys: {msg}");
}

fn from_dirs(include_dir: PathBuf, lib_dir: PathBuf, how: String) -> Ucx {
    if !include_dir.join("ucp/api/ucp.h").is_file() {
        fail(&format!(
            "{how}: no ucp/api/ucp.h under {}",
            include_dir.display()
        ));
    }
    if !lib_dir.join("libucp.so").exists() {
        fail(&format!("{how}: no libucp.so in {}", lib_dir.display()));
    }
    Ucx {
        include_dir,
        lib_dir,
        how,
    }
}

fn discover() -> Ucx {
    if let Some(prefix) = var("UCX_PREFIX") {
        let prefix = PathBuf::from(prefix);
        return from_dirs(
            prefix.join("include"),
            prefix.join("lib"),
            "UCX_PREFIX".into(),
        );
    }
    match (var("UCX_INCLUDE_DIR"), var("UCX_LIB_DIR")) {
        (Some(inc), Some(lib)) => {
            return from_dirs(inc.into(), lib.into(), "UCX_INCLUDE_DIR/UCX_LIB_DIR".into());
        }
        (Some(_), None) => {
            fail("UCX_INCLUDE_DIR is set but UCX_LIB_DIR is not; set both, or UCX_PREFIX")
        }
        (None, Some(_)) => {
            fail("UCX_LIB_DIR is set but UCX_INCLUDE_DIR is not; set both, or UCX_PREFIX")
        }
        (None, None) => {}
    }
    // pkg-config reads PKG_CONFIG_PATH and friends; the crate declares those itself.
    match pkg_config::Config::new()
        .range_version(MIN_VERSION..MAX_VERSION)
        .cargo_metadata(false)
        .probe("ucx")
    {
        Ok(lib) => {
            if let (Some(inc), Some(dir)) = (lib.include_paths.first(), lib.link_paths.first()) {
                return from_dirs(
                    inc.clone(),
                    dir.clone(),
                    format!("pkg-config ucx {}", lib.version),
                );
            }
            println!(
                "cargo:warning=pkg-config's ucx gave no include or lib dir; trying the provisioned UCX"
            );
        }
        Err(e) => {
            if !matches!(
                e,
                pkg_config::Error::Failure { .. } | pkg_config::Error::ProbeFailure { .. }
            ) {
                println!(
                    "cargo:warning=pkg-config ucx not usable ({e}); trying the provisioned UCX"
                );
            }
        }
    }
    if let Some(prefix) = var("KVX_PROVISIONED_UCX") {
        let prefix = PathBuf::from(prefix);
        if prefix.join("include/ucp/api/ucp.h").is_file() {
            return from_dirs(
                prefix.join("include"),
                prefix.join("lib"),
                "provisioned .deps/ucx".into(),
            );
        }
    }
    fail(
        "UCX not found. Run `scripts/provision` in the repository (installs UCX 1.22 headers and NIXL's \
         UCX into .deps/), or set UCX_PREFIX to a UCX >= 1.16 install, or make pkg-config find `ucx`.",
    )
}

fn main() {
    println!("cargo:rerun-if-changed=shim/shim.c");
    println!("cargo:rerun-if-changed=shim/shim.h");
    let ucx = discover();
    // Resolve links so rpaths and metadata name real folders, not a relative path from the config.
    let lib_dir = ucx.lib_dir.canonicalize().unwrap_or(ucx.lib_dir.clone());
    let include_dir = ucx
        .include_dir
        .canonicalize()
        .unwrap_or(ucx.include_dir.clone());
    println!(
        "cargo:warning=ucx-sys: using UCX from {} ({})",
        lib_dir.display(),
        ucx.how
    );

    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=ucp");
    println!("cargo:rustc-link-lib=dylib=ucs");
    // Dependents' build scripts read these as DEP_UCP_INCLUDE and DEP_UCP_LIB_DIR.
    println!("cargo:include={}", include_dir.display());
    println!("cargo:lib_dir={}", lib_dir.display());
    // This crate's own tests find the library without LD_LIBRARY_PATH.
    println!(
        "cargo:rustc-link-arg-tests=-Wl,-rpath,{}",
        lib_dir.display()
    );

    cc::Build::new()
        .file("shim/shim.c")
        .include(&include_dir)
        .warnings(true)
        .flag_if_supported("-Wno-sign-compare")
        .compile("kvx_ucx_shim");

    let out =
        PathBuf::from(env::var("OUT_DIR").unwrap_or_else(|_| fail("OUT_DIR not set by cargo")));
    generate(&include_dir, &out.join("bindings.rs"));
}

fn generate(include_dir: &Path, out: &Path) {
    let bindings = bindgen::Builder::default()
        .header("shim/shim.h")
        .clang_arg(format!("-I{}", include_dir.display()))
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_function("ucs_global_opts_set_value")
        .allowlist_function("kvx_.*")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_type("ucs_memory_type")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        // A status is an integer newtype: a value C gives us outside the known set stays a value.
        .newtype_enum("ucs_status_t")
        .newtype_enum("ucs_memory_type")
        .newtype_enum("ucp_err_handling_mode_t")
        .newtype_enum("ucp_worker_address_flags_t")
        .newtype_enum("ucs_thread_mode_t")
        .newtype_enum("ucp_am_cb_flags")
        .bitfield_enum("ucp_.*_field")
        .bitfield_enum("ucp_feature")
        .bitfield_enum("ucp_op_attr_t")
        .bitfield_enum("ucp_send_am_flags")
        .bitfield_enum("ucp_am_recv_attr_t")
        .bitfield_enum("ucp_mem_map_params_field")
        .bitfield_enum("ucp_mem_map_flags")
        .bitfield_enum("ucp_ep_params_flags_field")
        .bitfield_enum("ucp_ep_close_flags_t")
        .bitfield_enum("ucp_wakeup_event_types")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true)
        .prepend_enum_name(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate()
        .unwrap_or_else(|e| {
            fail(&format!(
                "bindgen failed on ucp.h ({e}); is libclang-dev installed?"
            ))
        });
    bindings
        .write_to_file(out)
        .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", out.display())));
}
