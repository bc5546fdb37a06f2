//! Embeds rpaths to the UCX and NIXL libraries the `-sys` crates linked, so that the extension module
//! loads them wherever Python imports it from.

fn main() {
    for var in ["DEP_UCP_LIB_DIR", "DEP_NIXL_CAPI_LIB_DIR"] {
        println!("cargo:rerun-if-env-changed={var}");
        match std::env::var(var) {
            Ok(dir) if !dir.is_empty() => println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}"),
            _ => println!(
                "cargo:warning={var} not set: the -sys crate did not export its library dir"
            ),
        }
    }
}
