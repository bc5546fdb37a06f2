//! Finds `libnixl_capi.so` and its plugin folder, and tells cargo how to link it.
//!
//! One ladder, first rung that is set wins:
//! 1. `NIXL_PREFIX`: a NIXL install of the user's own. The library is looked for in
//!    `$NIXL_PREFIX/lib`, then `$NIXL_PREFIX/lib/<arch>-linux-gnu` (meson's default on Debian-likes),
//!    then `$NIXL_PREFIX/lib64`; the first that holds `libnixl_capi.so` is used.
//! 2. `KVX_PROVISIONED_NIXL`: the folder `scripts/provision` fills (set by `.cargo/config.toml`),
//!    whose `lib/` is the `nixl-cu12` wheel's library folder.
//! 3. Otherwise the build fails and says how to get NIXL.
//!
//! No headers are involved: the declarations in `src/lib.rs` are written by hand, since the wheel
//! ships none.

use std::env;
use std::path::{Path, PathBuf};

const LIB_FILE: &str = "libnixl_capi.so";
const HOW_TO_INSTALL: &str = "install NIXL with `scripts/provision` (pip wheel nixl-cu12==1.5.1 into \
     .deps/), or point NIXL_PREFIX at a NIXL install whose lib/ holds libnixl_capi.so";

/// Where the library and its plugins were found.
struct Found {
    lib_dir: PathBuf,
    plugin_dir: PathBuf,
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    match find() {
        Ok(found) => emit(&found),
        // Fails the build with just this message, rather than a panic and a dump of our output.
        Err(message) => println!("cargo::error=nixl-sys: {message}"),
    }
}

/// Reads an environment variable and declares it as an input of this build script.
fn input_var(name: &str) -> Option<PathBuf> {
    println!("cargo::rerun-if-env-changed={name}");
    env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn find() -> Result<Found, String> {
    if let Some(prefix) = input_var("NIXL_PREFIX") {
        return from_prefix(&prefix);
    }
    if let Some(provisioned) = input_var("KVX_PROVISIONED_NIXL") {
        let lib_dir = provisioned.join("lib");
        if !lib_dir.join(LIB_FILE).is_file() {
            return Err(format!(
                "KVX_PROVISIONED_NIXL is {} but {} does not exist; run `scripts/provision` to \
                 (re)install it, or set NIXL_PREFIX to a NIXL install of your own",
                provisioned.display(),
                lib_dir.join(LIB_FILE).display()
            ));
        }
        let plugin_dir = plugin_dir_in(&lib_dir)?;
        return Ok(Found {
            lib_dir,
            plugin_dir,
        });
    }
    Err(format!(
        "NIXL not found: neither NIXL_PREFIX nor KVX_PROVISIONED_NIXL is set; {HOW_TO_INSTALL}"
    ))
}

fn from_prefix(prefix: &Path) -> Result<Found, String> {
    let arch = env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let candidates = [
        prefix.join("lib"),
        prefix.join("lib").join(format!("{arch}-linux-gnu")),
        prefix.join("lib64"),
    ];
    let Some(lib_dir) = candidates.iter().find(|d| d.join(LIB_FILE).is_file()) else {
        let tried: Vec<String> = candidates
            .iter()
            .map(|d| d.join(LIB_FILE).display().to_string())
            .collect();
        return Err(format!(
            "NIXL_PREFIX is {} but {LIB_FILE} is in none of: {}; fix NIXL_PREFIX, or unset it to \
             use the provisioned NIXL (`scripts/provision`)",
            prefix.display(),
            tried.join(", ")
        ));
    };
    let plugin_dir = plugin_dir_in(lib_dir)?;
    Ok(Found {
        lib_dir: lib_dir.clone(),
        plugin_dir,
    })
}

/// NIXL installs its backend plugins in `plugins/` next to its libraries; both the wheel and a
/// meson install do.
fn plugin_dir_in(lib_dir: &Path) -> Result<PathBuf, String> {
    let plugin_dir = lib_dir.join("plugins");
    if !plugin_dir.is_dir() {
        return Err(format!(
            "{} exists but its plugin folder {} does not; the NIXL install is incomplete ({HOW_TO_INSTALL})",
            lib_dir.join(LIB_FILE).display(),
            plugin_dir.display()
        ));
    }
    if !plugin_dir.join("libplugin_UCX.so").is_file() {
        println!(
            "cargo::warning=nixl-sys: {} has no libplugin_UCX.so; agents will not be able to create \
             the UCX backend",
            plugin_dir.display()
        );
    }
    Ok(plugin_dir)
}

fn emit(found: &Found) {
    let lib_dir = found.lib_dir.display();
    let plugin_dir = found.plugin_dir.display();
    // A reinstall in place (new wheel, new build) must relink.
    println!(
        "cargo::rerun-if-changed={}",
        found.lib_dir.join(LIB_FILE).display()
    );

    println!("cargo::rustc-link-search=native={lib_dir}");
    println!("cargo::rustc-link-lib=dylib=nixl_capi");

    // For dependents' build scripts: DEP_NIXL_CAPI_LIB_DIR and DEP_NIXL_CAPI_PLUGIN_DIR.
    println!("cargo::metadata=lib_dir={lib_dir}");
    println!("cargo::metadata=plugin_dir={plugin_dir}");

    // Compile-time constants `LIB_DIR` and `PLUGIN_DIR` in src/lib.rs.
    println!("cargo::rustc-env=NIXL_SYS_LIB_DIR={lib_dir}");
    println!("cargo::rustc-env=NIXL_SYS_PLUGIN_DIR={plugin_dir}");

    // This crate's own test, example and bench binaries (it has no other linked targets) find
    // libnixl_capi.so without LD_LIBRARY_PATH; libnixl_capi.so's own RPATH ($ORIGIN) finds the
    // rest of NIXL and its UCX. Not `rustc-link-arg-tests` and friends: cargo rejects those when
    // the package has no target of that kind (no examples/, no benches/). Binaries of other crates
    // get their rpath from their own build scripts (DEP_NIXL_CAPI_LIB_DIR).
    println!("cargo::rustc-link-arg=-Wl,-rpath,{lib_dir}");
}
