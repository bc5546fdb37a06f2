//! Embeds an rpath to the UCX and NIXL libraries so this crate's tests and doctests run without
//! `LD_LIBRARY_PATH`. (A library cannot pass rpaths on to binaries of other packages; those embed
//! their own, as the root package's build script does.)

fn main() {
    for var in ["DEP_UCP_LIB_DIR", "DEP_NIXL_CAPI_LIB_DIR"] {
        println!("cargo:rerun-if-env-changed={var}");
        if let Ok(dir) = std::env::var(var)
            && !dir.is_empty()
        {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
