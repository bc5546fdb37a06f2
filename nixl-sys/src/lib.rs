//! Raw declarations of NIXL's C API, `libnixl_capi`, as shipped in the `nixl-cu12` 1.5.1 wheel.
//!
//! Nothing here allocates, spawns a thread or decides anything: these are the C functions, their
//! handle types and their integer constants, for the NIXL backend of `transfer-engine` to wrap.
//!
//! ```
//! use nixl_sys as ffi;
//! use std::ptr;
//!
//! fn main() -> Result<(), ffi::nixl_capi_status_t> {
//!     let cfg = ffi::nixl_capi_agent_config_t {
//!         enable_prog_thread: false, // we poll the agent ourselves
//!         enable_listen_thread: false,
//!         listen_port: 0,
//!         thread_sync: ffi::NIXL_CAPI_THREAD_SYNC_NONE,
//!         num_workers: 1,
//!         pthr_delay_us: 0,
//!         lthr_delay_us: 100_000,
//!         capture_telemetry: false,
//!     };
//!     let mut agent: ffi::nixl_capi_agent_t = ptr::null_mut();
//!     // SAFETY: the name is a NUL-terminated literal and `cfg` and `agent` are live locals; the
//!     // library copies the name and the config before it returns.
//!     let status =
//!         unsafe { ffi::nixl_capi_create_configured_agent(c"example".as_ptr(), &cfg, &mut agent) };
//!     if status != ffi::NIXL_CAPI_SUCCESS {
//!         return Err(status);
//!     }
//!
//!     let mut plugins: ffi::nixl_capi_string_list_t = ptr::null_mut();
//!     let mut count = 0;
//!     // SAFETY: `agent` was just created and is destroyed below, after its last use; the out
//!     // pointers are live locals.
//!     let status = unsafe {
//!         let s = ffi::nixl_capi_get_available_plugins(agent, &mut plugins);
//!         if s == ffi::NIXL_CAPI_SUCCESS {
//!             ffi::nixl_capi_string_list_size(plugins, &mut count);
//!             ffi::nixl_capi_destroy_string_list(plugins);
//!         }
//!         ffi::nixl_capi_destroy_agent(agent);
//!         s
//!     };
//!     if status != ffi::NIXL_CAPI_SUCCESS {
//!         return Err(status);
//!     }
//!     println!("{count} backend plugins in {}", ffi::PLUGIN_DIR);
//!     Ok(())
//! }
//! ```
//!
//! # Library dependency
//!
//! The build script links `libnixl_capi.so` from the first of: `NIXL_PREFIX` (its `lib/`,
//! `lib/<arch>-linux-gnu/` or `lib64/`), or `KVX_PROVISIONED_NIXL`, the folder that
//! `scripts/provision` fills from the `nixl-cu12==1.5.1` wheel. The wheel ships no C headers; the
//! declarations below are written by hand from the C API's header in NIXL 1.5.1 (`wrapper.h` of
//! NIXL's Rust bindings, identical in 1.5.2), and every one of them is a symbol that
//! `nm -D --defined-only libnixl_capi.so` lists.
//!
//! `libnixl_capi.so` finds the rest of NIXL and its bundled UCX 1.23 through its own
//! `RPATH=$ORIGIN/.:$ORIGIN/../nixl_cu12.libs`; a binary only has to find `libnixl_capi.so` itself.
//! This crate's own tests, examples and benches get an rpath to [`LIB_DIR`]; other binaries get
//! theirs from their build script, which reads `DEP_NIXL_CAPI_LIB_DIR` (and
//! `DEP_NIXL_CAPI_PLUGIN_DIR`).
//!
//! NIXL loads its backends (`libplugin_UCX.so`, ...) with `dlopen`. Its plugin manager is a
//! process-wide singleton that, when first used (the first agent), takes its folder from the
//! environment variable `NIXL_PLUGIN_DIR` (or the same key in the file named by
//! `NIXL_CONFIG_FILE`), and otherwise from the path `dladdr` reports for `libnixl.so`. Loaded
//! through `libnixl_capi.so`'s `RPATH=$ORIGIN/.`, that path is `<lib>/./libnixl.so`, and NIXL
//! 1.5.1 logs (at `NIXL_LOG_LEVEL=DEBUG`) "Loading plugins from: `<lib>/./plugins`", which is
//! [`PLUGIN_DIR`]. So no variable is needed for the wheel or for a meson install, where the
//! plugins sit in `plugins/` next to the libraries. The C API has no call to add a plugin folder,
//! and the variable is read once per process: a caller that wants another folder sets it before
//! the first agent exists.
//!
//! # Thread safety
//!
//! All handles are raw pointers, so none of them is `Send` or `Sync` here; a safe layer that
//! shares them must argue it from these facts about the C library:
//! - An agent's own calls lock according to its `thread_sync` mode:
//!   [`NIXL_CAPI_THREAD_SYNC_NONE`] takes no lock (one thread at a time, the caller's job),
//!   [`NIXL_CAPI_THREAD_SYNC_STRICT`] serialises every call, [`NIXL_CAPI_THREAD_SYNC_RW`] takes a
//!   reader-writer lock that some data-path calls share (which ones is NIXL's choice and may
//!   change; rely on no more than "safe from several threads").
//! - Everything else (descriptor lists, option arguments, parameter maps, string lists,
//!   notification maps) is a plain C++ container without a lock: one thread at a time.
//! - With `enable_prog_thread` off, nothing moves unless the caller polls: every agent involved,
//!   the target as well as the initiator, must be driven by calls such as
//!   [`nixl_capi_get_xfer_status`] or [`nixl_capi_get_notifs`], or not even connection setup
//!   completes. With it on, NIXL runs one background thread per agent.
//!
//! # Resource cleanup
//!
//! What must be released, and with what (everything else returned is borrowed):
//! - agent: [`nixl_capi_destroy_agent`], after everything that names it is released. It tears down
//!   the agent's backends.
//! - backend handle (from [`nixl_capi_create_backend`] or [`nixl_capi_query_xfer_backend`]):
//!   [`nixl_capi_destroy_backend`] frees the handle only; the backend lives until its agent goes.
//! - parameter maps and memory lists: [`nixl_capi_destroy_params`], [`nixl_capi_destroy_mem_list`];
//!   parameter iterators: [`nixl_capi_params_destroy_iterator`]; string lists:
//!   [`nixl_capi_destroy_string_list`]; query responses: [`nixl_capi_destroy_query_resp_list`].
//! - option arguments: [`nixl_capi_destroy_opt_args`].
//! - descriptor lists: [`nixl_capi_destroy_xfer_dlist`], [`nixl_capi_destroy_reg_dlist`],
//!   [`nixl_capi_destroy_remote_dlist`]. NIXL copies a list into whatever uses it, so a list may be
//!   destroyed as soon as the call that took it returns.
//! - registrations: [`nixl_capi_deregister_mem`] with a list describing the same memory.
//! - transfer requests, two steps: [`nixl_capi_release_xfer_req`] releases NIXL's request (and
//!   tries to cancel it if still in progress), then [`nixl_capi_destroy_xfer_req`] frees the handle.
//!   Destroying an unreleased handle returns [`NIXL_CAPI_ERROR_INVALID_STATE`] and frees nothing.
//! - prepared descriptor list handles: [`nixl_capi_release_xfer_dlist_handle`]; memory views:
//!   [`nixl_capi_release_mem_view`].
//! - notification maps: [`nixl_capi_destroy_notif_map`].
//! - bytes and strings the library allocates for the caller (metadata from
//!   [`nixl_capi_get_local_md`] and [`nixl_capi_get_local_partial_md`], the agent name from
//!   [`nixl_capi_load_remote_md`], copies from [`nixl_capi_opt_args_get_notif_msg`] and
//!   [`nixl_capi_opt_args_get_custom_param`]): C `free()`.

#![allow(non_camel_case_types)]
#![warn(missing_docs)]

use core::ffi::{c_char, c_int, c_uint, c_void};

/// The folder `libnixl_capi.so` was linked from, as found by the build script.
pub const LIB_DIR: &str = env!("NIXL_SYS_LIB_DIR");

/// The folder holding NIXL's backend plugins (`libplugin_UCX.so`, ...) of the linked NIXL.
///
/// NIXL finds this folder by itself when loaded from [`LIB_DIR`] (see the crate docs); a caller
/// that wants to be explicit sets [`NIXL_PLUGIN_DIR_ENV`] to it before creating the first agent.
pub const PLUGIN_DIR: &str = env!("NIXL_SYS_PLUGIN_DIR");

/// The environment variable NIXL reads, once per process, for its plugin folder.
pub const NIXL_PLUGIN_DIR_ENV: &str = "NIXL_PLUGIN_DIR";

// ---------------------------------------------------------------------------------------------
// Status codes
// ---------------------------------------------------------------------------------------------

/// What every C API call returns: `0` success, `1` in progress, negative an error.
///
/// Kept as a plain integer: the library may return a value this crate does not name.
pub type nixl_capi_status_t = c_int;

/// The call succeeded (for a transfer: it is complete).
pub const NIXL_CAPI_SUCCESS: nixl_capi_status_t = 0;
/// A posted transfer is still under way; poll again. Not an error.
pub const NIXL_CAPI_IN_PROG: nixl_capi_status_t = 1;
/// A null handle or pointer, an index out of range, or NIXL's `NIXL_ERR_INVALID_PARAM`.
pub const NIXL_CAPI_ERROR_INVALID_PARAM: nixl_capi_status_t = -1;
/// Any other NIXL error. The C API folds into this one code NIXL's backend, mismatch,
/// not-allowed, not-posted, repost-active, unknown, not-supported, remote-disconnect and
/// cancelled errors, and any C++ exception.
pub const NIXL_CAPI_ERROR_BACKEND: nixl_capi_status_t = -2;
/// The handle is in the wrong state for the call (a transfer request destroyed before release).
pub const NIXL_CAPI_ERROR_INVALID_STATE: nixl_capi_status_t = -3;
/// Reserved by the C API for exceptions; 1.5.1 reports them as [`NIXL_CAPI_ERROR_BACKEND`].
pub const NIXL_CAPI_ERROR_EXCEPTION: nixl_capi_status_t = -4;
/// Telemetry was asked for but the agent does not capture it.
pub const NIXL_CAPI_ERROR_NO_TELEMETRY: nixl_capi_status_t = -5;
/// The remote agent's metadata is not loaded, or no backend serves the request.
pub const NIXL_CAPI_ERROR_NOT_FOUND: nixl_capi_status_t = -6;

// ---------------------------------------------------------------------------------------------
// Other C enums, as integers
// ---------------------------------------------------------------------------------------------

/// Memory kind of a descriptor list (NIXL's `nixl_mem_t`).
pub type nixl_capi_mem_type_t = c_uint;
/// Host memory.
pub const NIXL_CAPI_MEM_DRAM: nixl_capi_mem_type_t = 0;
/// GPU memory; `dev_id` is the CUDA device ordinal.
pub const NIXL_CAPI_MEM_VRAM: nixl_capi_mem_type_t = 1;
/// Block storage.
pub const NIXL_CAPI_MEM_BLOCK: nixl_capi_mem_type_t = 2;
/// Object storage.
pub const NIXL_CAPI_MEM_OBJECT: nixl_capi_mem_type_t = 3;
/// Files.
pub const NIXL_CAPI_MEM_FILE: nixl_capi_mem_type_t = 4;
/// Unknown memory kind.
pub const NIXL_CAPI_MEM_UNKNOWN: nixl_capi_mem_type_t = 5;

/// How an agent locks around its calls (NIXL's `nixl_thread_sync_t`).
pub type nixl_capi_thread_sync_t = c_uint;
/// No locking: the caller uses the agent from one thread at a time.
pub const NIXL_CAPI_THREAD_SYNC_NONE: nixl_capi_thread_sync_t = 0;
/// One lock around every call.
pub const NIXL_CAPI_THREAD_SYNC_STRICT: nixl_capi_thread_sync_t = 1;
/// A reader-writer lock: some data-path calls share it, the rest take it exclusively.
pub const NIXL_CAPI_THREAD_SYNC_RW: nixl_capi_thread_sync_t = 2;
/// NIXL's default, which is [`NIXL_CAPI_THREAD_SYNC_NONE`].
pub const NIXL_CAPI_THREAD_SYNC_DEFAULT: nixl_capi_thread_sync_t = NIXL_CAPI_THREAD_SYNC_NONE;

/// Direction of a transfer, seen from the initiator (NIXL's `nixl_xfer_op_t`).
pub type nixl_capi_xfer_op_t = c_uint;
/// Remote to local.
pub const NIXL_CAPI_XFER_OP_READ: nixl_capi_xfer_op_t = 0;
/// Local to remote.
pub const NIXL_CAPI_XFER_OP_WRITE: nixl_capi_xfer_op_t = 1;

/// How [`nixl_capi_estimate_xfer_cost`] arrived at its estimate (NIXL's `nixl_cost_t`).
pub type nixl_capi_cost_t = c_uint;
/// The backend's analytical model.
pub const NIXL_CAPI_COST_ANALYTICAL_BACKEND: nixl_capi_cost_t = 0;

// ---------------------------------------------------------------------------------------------
// Structs passed by value or filled in by the caller
// ---------------------------------------------------------------------------------------------

/// Agent configuration for [`nixl_capi_create_configured_agent`]; every field is read.
///
/// NIXL's own defaults, for reference: no progress thread, no listen thread, sync NONE, progress
/// delay 0, listen delay 100 000 us, no telemetry. `num_workers` is ignored by the 1.5.1 C API
/// (the UCX backend takes its worker count as the backend parameter `num_workers`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct nixl_capi_agent_config_s {
    /// Run a background thread that progresses the agent's backends.
    pub enable_prog_thread: bool,
    /// Run a thread that serves metadata over a socket on `listen_port`.
    pub enable_listen_thread: bool,
    /// Port for the listen thread; truncated to 16 bits by the library.
    pub listen_port: c_int,
    /// Locking mode, one of the `NIXL_CAPI_THREAD_SYNC_*` constants.
    pub thread_sync: nixl_capi_thread_sync_t,
    /// Ignored by the 1.5.1 C API.
    pub num_workers: c_uint,
    /// Progress thread wake-up period in microseconds.
    pub pthr_delay_us: u64,
    /// Listen thread wake-up period in microseconds.
    pub lthr_delay_us: u64,
    /// Capture per-transfer telemetry even if the environment does not ask for it.
    pub capture_telemetry: bool,
}

/// The C API's name for [`nixl_capi_agent_config_s`] (a typedef of the struct, not a pointer).
pub type nixl_capi_agent_config_t = nixl_capi_agent_config_s;

/// Telemetry of one transfer, filled in by [`nixl_capi_get_xfer_telemetry`] into caller memory.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct nixl_capi_xfer_telemetry_s {
    /// When the transfer was posted, in microseconds of the C++ steady clock (not wall time).
    pub start_time_us: u64,
    /// Time spent inside the post call, in microseconds.
    pub post_duration_us: u64,
    /// Time from post to completion, in microseconds.
    pub xfer_duration_us: u64,
    /// Bytes moved.
    pub total_bytes: u64,
    /// Number of descriptors.
    pub desc_count: u64,
}

/// Pointer to caller-owned telemetry; the C API's `nixl_capi_xfer_telemetry_t`.
pub type nixl_capi_xfer_telemetry_t = *mut nixl_capi_xfer_telemetry_s;

// ---------------------------------------------------------------------------------------------
// Opaque handles
// ---------------------------------------------------------------------------------------------

macro_rules! opaque_handles {
    ($($(#[$doc:meta])* $s:ident => $t:ident;)*) => {$(
        $(#[$doc])*
        ///
        /// Opaque: only ever behind a pointer the library handed out.
        #[repr(C)]
        #[derive(Debug)]
        pub struct $s {
            _private: [u8; 0],
            // Not Send, Sync or Unpin: what the C++ object allows is for the safe layer to say.
            _marker: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
        }

        #[doc = concat!("Handle to a [`", stringify!($s), "`]; null when not set.")]
        pub type $t = *mut $s;
    )*};
}

opaque_handles! {
    /// A NIXL agent: one endpoint with its backends, registrations and known peers.
    nixl_capi_agent_s => nixl_capi_agent_t;
    /// A map of backend parameters, string keys to string values.
    nixl_capi_params_s => nixl_capi_params_t;
    /// A list of memory kinds a backend supports.
    nixl_capi_mem_list_s => nixl_capi_mem_list_t;
    /// A list of strings (plugin names).
    nixl_capi_string_list_s => nixl_capi_string_list_t;
    /// A backend instance created on an agent.
    nixl_capi_backend_s => nixl_capi_backend_t;
    /// Optional arguments: backends to use, notification message, merge control, ...
    nixl_capi_opt_args_s => nixl_capi_opt_args_t;
    /// An iterator over a parameter map.
    nixl_capi_param_iter_s => nixl_capi_param_iter_t;
    /// A transfer descriptor list: (address, length, device id) triples of one memory kind.
    nixl_capi_xfer_dlist_s => nixl_capi_xfer_dlist_t;
    /// A transfer descriptor list prepared against an agent for [`nixl_capi_make_xfer_req`].
    nixl_capi_xfer_dlist_handle_s => nixl_capi_xfer_dlist_handle_t;
    /// A registration descriptor list: descriptors with optional per-descriptor metadata.
    nixl_capi_reg_dlist_s => nixl_capi_reg_dlist_t;
    /// A transfer request.
    nixl_capi_xfer_req_s => nixl_capi_xfer_req_t;
    /// Received notifications, grouped by sender agent name.
    nixl_capi_notif_map_s => nixl_capi_notif_map_t;
    /// Responses of [`nixl_capi_query_mem`], one per descriptor.
    nixl_capi_query_resp_list_s => nixl_capi_query_resp_list_t;
    /// A remote descriptor list: descriptors that each name their owning agent.
    nixl_capi_remote_dlist_s => nixl_capi_remote_dlist_t;
    /// A prepared memory view.
    nixl_capi_mem_view_s => nixl_capi_mem_view_t;
}

// ---------------------------------------------------------------------------------------------
// Functions
// ---------------------------------------------------------------------------------------------
//
// Common rules, not repeated per item: every handle argument must be one the library returned and
// that is not yet destroyed, or null where a function says it accepts null (all `opt_args`
// arguments do; a null handle elsewhere gives NIXL_CAPI_ERROR_INVALID_PARAM); every `*const c_char`
// is a NUL-terminated string, copied before the call returns; every out pointer is valid for a
// write. Out values are written only on success.

unsafe extern "C" {
    // --- Agents ---------------------------------------------------------------------------

    /// Creates an agent named `name` with the given configuration.
    pub fn nixl_capi_create_configured_agent(
        name: *const c_char,
        cfg: *const nixl_capi_agent_config_t,
        agent: *mut nixl_capi_agent_t,
    ) -> nixl_capi_status_t;

    /// Creates an agent with NIXL's defaults, except that the progress thread is on.
    pub fn nixl_capi_create_agent(
        name: *const c_char,
        agent: *mut nixl_capi_agent_t,
    ) -> nixl_capi_status_t;

    /// Destroys an agent, its backends and its registrations.
    pub fn nixl_capi_destroy_agent(agent: nixl_capi_agent_t) -> nixl_capi_status_t;

    /// True for NIXL's stub library (every call fails); false for the real one.
    pub fn nixl_capi_is_stub() -> bool;

    // --- Metadata -------------------------------------------------------------------------

    /// Serialises the agent's metadata (name, backends' connection info, registrations) into a
    /// new buffer at `*data` of `*len` bytes, which the caller frees with `free()`.
    pub fn nixl_capi_get_local_md(
        agent: nixl_capi_agent_t,
        data: *mut *mut c_void,
        len: *mut usize,
    ) -> nixl_capi_status_t;

    /// Like [`nixl_capi_get_local_md`], restricted to the registrations in `descs` (an empty
    /// list gives connection info only). The buffer is freed with `free()`.
    pub fn nixl_capi_get_local_partial_md(
        agent: nixl_capi_agent_t,
        descs: nixl_capi_reg_dlist_t,
        data: *mut *mut c_void,
        len: *mut usize,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Loads a peer's metadata blob (`len` > 0 bytes at `data`, copied) and writes the peer's
    /// name, a new `strdup` string the caller frees with `free()`, to `*agent_name`.
    pub fn nixl_capi_load_remote_md(
        agent: nixl_capi_agent_t,
        data: *const c_void,
        len: usize,
        agent_name: *mut *mut c_char,
    ) -> nixl_capi_status_t;

    /// Forgets a peer's metadata and disconnects from it.
    pub fn nixl_capi_invalidate_remote_md(
        agent: nixl_capi_agent_t,
        remote_agent: *const c_char,
    ) -> nixl_capi_status_t;

    /// Withdraws this agent's metadata from the metadata service (etcd or a peer socket).
    pub fn nixl_capi_invalidate_local_md(
        agent: nixl_capi_agent_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Checks that the peer's metadata is loaded and, if `descs` is not null, that it covers
    /// `descs`. Success means yes; [`NIXL_CAPI_ERROR_NOT_FOUND`] means not (yet).
    pub fn nixl_capi_check_remote_md(
        agent: nixl_capi_agent_t,
        remote_name: *const c_char,
        descs: nixl_capi_xfer_dlist_t,
    ) -> nixl_capi_status_t;

    /// Publishes this agent's metadata to the metadata service (etcd, or the peer at the
    /// `opt_args` IP address and port).
    pub fn nixl_capi_send_local_md(
        agent: nixl_capi_agent_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Publishes the part of this agent's metadata that covers `descs`.
    pub fn nixl_capi_send_local_partial_md(
        agent: nixl_capi_agent_t,
        descs: nixl_capi_reg_dlist_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Asks the metadata service for a peer's metadata; it arrives asynchronously (see
    /// [`nixl_capi_check_remote_md`]).
    pub fn nixl_capi_fetch_remote_md(
        agent: nixl_capi_agent_t,
        remote_name: *const c_char,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Connects to a peer whose metadata is loaded, ahead of the first transfer.
    pub fn nixl_capi_agent_make_connection(
        agent: nixl_capi_agent_t,
        remote_agent: *const c_char,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    // --- Plugins, backends, parameters ------------------------------------------------------

    /// Lists the backend plugins found in the plugin folder, as a new string list.
    pub fn nixl_capi_get_available_plugins(
        agent: nixl_capi_agent_t,
        plugins: *mut nixl_capi_string_list_t,
    ) -> nixl_capi_status_t;

    /// Frees a string list and the strings borrowed from it.
    pub fn nixl_capi_destroy_string_list(list: nixl_capi_string_list_t) -> nixl_capi_status_t;

    /// Number of strings in the list.
    pub fn nixl_capi_string_list_size(
        list: nixl_capi_string_list_t,
        size: *mut usize,
    ) -> nixl_capi_status_t;

    /// Borrows string `index`; valid until the list is destroyed.
    pub fn nixl_capi_string_list_get(
        list: nixl_capi_string_list_t,
        index: usize,
        str_: *mut *const c_char,
    ) -> nixl_capi_status_t;

    /// A plugin's supported memory kinds and default parameters, as a new list and a new map.
    /// Loads the plugin. Any failure is reported as [`NIXL_CAPI_ERROR_BACKEND`].
    pub fn nixl_capi_get_plugin_params(
        agent: nixl_capi_agent_t,
        plugin_name: *const c_char,
        mems: *mut nixl_capi_mem_list_t,
        params: *mut nixl_capi_params_t,
    ) -> nixl_capi_status_t;

    /// Frees a memory-kind list.
    pub fn nixl_capi_destroy_mem_list(list: nixl_capi_mem_list_t) -> nixl_capi_status_t;

    /// Frees a parameter map.
    pub fn nixl_capi_destroy_params(params: nixl_capi_params_t) -> nixl_capi_status_t;

    /// Creates a backend of plugin `plugin_name` ("UCX", ...) on the agent, configured by
    /// `params` (copied). Any failure is reported as [`NIXL_CAPI_ERROR_BACKEND`].
    pub fn nixl_capi_create_backend(
        agent: nixl_capi_agent_t,
        plugin_name: *const c_char,
        params: nixl_capi_params_t,
        backend: *mut nixl_capi_backend_t,
    ) -> nixl_capi_status_t;

    /// Frees a backend handle. The backend itself stays with its agent until the agent is
    /// destroyed.
    pub fn nixl_capi_destroy_backend(backend: nixl_capi_backend_t) -> nixl_capi_status_t;

    /// A live backend's memory kinds and effective parameters, as a new list and a new map.
    pub fn nixl_capi_get_backend_params(
        agent: nixl_capi_agent_t,
        backend: nixl_capi_backend_t,
        mems: *mut nixl_capi_mem_list_t,
        params: *mut nixl_capi_params_t,
    ) -> nixl_capi_status_t;

    /// Creates an empty parameter map.
    pub fn nixl_capi_create_params(params: *mut nixl_capi_params_t) -> nixl_capi_status_t;

    /// Sets `key` to `value` in the map (both copied), replacing an earlier value.
    pub fn nixl_capi_params_add(
        params: nixl_capi_params_t,
        key: *const c_char,
        value: *const c_char,
    ) -> nixl_capi_status_t;

    /// Whether the map is empty.
    pub fn nixl_capi_params_is_empty(
        params: nixl_capi_params_t,
        is_empty: *mut bool,
    ) -> nixl_capi_status_t;

    /// Creates an iterator over the map; the map must outlive it and stay unchanged meanwhile.
    pub fn nixl_capi_params_create_iterator(
        params: nixl_capi_params_t,
        iter: *mut nixl_capi_param_iter_t,
    ) -> nixl_capi_status_t;

    /// Yields the next entry, borrowed until the next call on this iterator. `*has_next` tells
    /// whether another entry follows. On an exhausted (or empty) map it writes only
    /// `*has_next = false` and leaves `*key` and `*value` alone, so check emptiness first.
    pub fn nixl_capi_params_iterator_next(
        iter: nixl_capi_param_iter_t,
        key: *mut *const c_char,
        value: *mut *const c_char,
        has_next: *mut bool,
    ) -> nixl_capi_status_t;

    /// Frees an iterator.
    pub fn nixl_capi_params_destroy_iterator(iter: nixl_capi_param_iter_t) -> nixl_capi_status_t;

    /// Whether the memory-kind list is empty.
    pub fn nixl_capi_mem_list_is_empty(
        list: nixl_capi_mem_list_t,
        is_empty: *mut bool,
    ) -> nixl_capi_status_t;

    /// Number of memory kinds in the list.
    pub fn nixl_capi_mem_list_size(
        list: nixl_capi_mem_list_t,
        size: *mut usize,
    ) -> nixl_capi_status_t;

    /// Memory kind `index`, one of the `NIXL_CAPI_MEM_*` values (or a newer one).
    pub fn nixl_capi_mem_list_get(
        list: nixl_capi_mem_list_t,
        index: usize,
        mem_type: *mut nixl_capi_mem_type_t,
    ) -> nixl_capi_status_t;

    /// Static name of a memory kind ("DRAM", "VRAM", ...); unknown values are
    /// [`NIXL_CAPI_ERROR_INVALID_PARAM`].
    pub fn nixl_capi_mem_type_to_string(
        mem_type: nixl_capi_mem_type_t,
        str_: *mut *const c_char,
    ) -> nixl_capi_status_t;

    // --- Optional arguments -----------------------------------------------------------------

    /// Creates empty optional arguments.
    pub fn nixl_capi_create_opt_args(args: *mut nixl_capi_opt_args_t) -> nixl_capi_status_t;

    /// Frees optional arguments.
    pub fn nixl_capi_destroy_opt_args(args: nixl_capi_opt_args_t) -> nixl_capi_status_t;

    /// Restricts the call these arguments go with to `backend` (may be called for several).
    /// The backend must outlive the arguments' use.
    pub fn nixl_capi_opt_args_add_backend(
        args: nixl_capi_opt_args_t,
        backend: nixl_capi_backend_t,
    ) -> nixl_capi_status_t;

    /// Sets the notification bytes (`len` bytes at `data`, copied; `data` may be null only if
    /// `len` is 0). A transfer sends them only once [`nixl_capi_opt_args_set_has_notif`] is true.
    pub fn nixl_capi_opt_args_set_notif_msg(
        args: nixl_capi_opt_args_t,
        data: *const c_void,
        len: usize,
    ) -> nixl_capi_status_t;

    /// Copies out the notification bytes into a new buffer the caller frees with `free()`; an
    /// empty message gives null and 0.
    pub fn nixl_capi_opt_args_get_notif_msg(
        args: nixl_capi_opt_args_t,
        data: *mut *mut c_void,
        len: *mut usize,
    ) -> nixl_capi_status_t;

    /// Sets the backend-defined custom parameter blob (copied; `data` may be null only if `len`
    /// is 0).
    pub fn nixl_capi_opt_args_set_custom_param(
        args: nixl_capi_opt_args_t,
        data: *const c_void,
        len: usize,
    ) -> nixl_capi_status_t;

    /// Copies out the custom parameter into a new buffer the caller frees with `free()`; unset
    /// gives null and 0.
    pub fn nixl_capi_opt_args_get_custom_param(
        args: nixl_capi_opt_args_t,
        data: *mut *mut c_void,
        len: *mut usize,
    ) -> nixl_capi_status_t;

    /// Whether a transfer made with these arguments sends the notification message when it
    /// completes.
    pub fn nixl_capi_opt_args_set_has_notif(
        args: nixl_capi_opt_args_t,
        has_notif: bool,
    ) -> nixl_capi_status_t;

    /// Reads the flag set by [`nixl_capi_opt_args_set_has_notif`].
    pub fn nixl_capi_opt_args_get_has_notif(
        args: nixl_capi_opt_args_t,
        has_notif: *mut bool,
    ) -> nixl_capi_status_t;

    /// Keeps adjacent descriptors of a transfer apart instead of merging them.
    pub fn nixl_capi_opt_args_set_skip_desc_merge(
        args: nixl_capi_opt_args_t,
        skip_merge: bool,
    ) -> nixl_capi_status_t;

    /// Reads the flag set by [`nixl_capi_opt_args_set_skip_desc_merge`].
    pub fn nixl_capi_opt_args_get_skip_desc_merge(
        args: nixl_capi_opt_args_t,
        skip_merge: *mut bool,
    ) -> nixl_capi_status_t;

    /// Peer IP address for socket metadata exchange (copied).
    pub fn nixl_capi_opt_args_set_ip_addr(
        args: nixl_capi_opt_args_t,
        ip_addr: *const c_char,
    ) -> nixl_capi_status_t;

    /// Peer port for socket metadata exchange.
    pub fn nixl_capi_opt_args_set_port(args: nixl_capi_opt_args_t, port: u16)
    -> nixl_capi_status_t;

    // --- Memory registration ------------------------------------------------------------------

    /// Registers every descriptor of `dlist` with the agent's backends (or those in
    /// `opt_args`). The memory must stay valid until it is deregistered.
    pub fn nixl_capi_register_mem(
        agent: nixl_capi_agent_t,
        dlist: nixl_capi_reg_dlist_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Deregisters memory registered earlier with a list of the same descriptors.
    pub fn nixl_capi_deregister_mem(
        agent: nixl_capi_agent_t,
        dlist: nixl_capi_reg_dlist_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Asks the backends about each descriptor (for storage backends: does it exist, its size).
    /// Fills `resp`, which the caller created.
    pub fn nixl_capi_query_mem(
        agent: nixl_capi_agent_t,
        descs: nixl_capi_reg_dlist_t,
        resp: nixl_capi_query_resp_list_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Creates an empty query response list.
    pub fn nixl_capi_create_query_resp_list(
        list: *mut nixl_capi_query_resp_list_t,
    ) -> nixl_capi_status_t;

    /// Frees a query response list.
    pub fn nixl_capi_destroy_query_resp_list(
        list: nixl_capi_query_resp_list_t,
    ) -> nixl_capi_status_t;

    /// Number of responses.
    pub fn nixl_capi_query_resp_list_size(
        list: nixl_capi_query_resp_list_t,
        size: *mut usize,
    ) -> nixl_capi_status_t;

    /// Whether response `index` holds a value.
    pub fn nixl_capi_query_resp_list_has_value(
        list: nixl_capi_query_resp_list_t,
        index: usize,
        has_value: *mut bool,
    ) -> nixl_capi_status_t;

    /// Copies response `index` into a new parameter map (freed with
    /// [`nixl_capi_destroy_params`]); a response without a value is
    /// [`NIXL_CAPI_ERROR_INVALID_PARAM`].
    pub fn nixl_capi_query_resp_list_get_params(
        list: nixl_capi_query_resp_list_t,
        index: usize,
        params: *mut nixl_capi_params_t,
    ) -> nixl_capi_status_t;

    // --- Registration descriptor lists ------------------------------------------------------

    /// Creates an empty registration list of memory kind `mem_type`.
    pub fn nixl_capi_create_reg_dlist(
        mem_type: nixl_capi_mem_type_t,
        dlist: *mut nixl_capi_reg_dlist_t,
    ) -> nixl_capi_status_t;

    /// Frees a registration list (not the registrations made with it).
    pub fn nixl_capi_destroy_reg_dlist(dlist: nixl_capi_reg_dlist_t) -> nixl_capi_status_t;

    /// The list's memory kind.
    pub fn nixl_capi_reg_dlist_get_type(
        dlist: nixl_capi_reg_dlist_t,
        mem_type: *mut nixl_capi_mem_type_t,
    ) -> nixl_capi_status_t;

    /// Appends a descriptor: `len` bytes at `addr` on device `dev_id` (0 for host memory), with
    /// optional backend metadata (`metadata_len` bytes, copied; null for none).
    pub fn nixl_capi_reg_dlist_add_desc(
        dlist: nixl_capi_reg_dlist_t,
        addr: usize,
        len: usize,
        dev_id: u64,
        metadata: *const c_void,
        metadata_len: usize,
    ) -> nixl_capi_status_t;

    /// Number of descriptors.
    pub fn nixl_capi_reg_dlist_desc_count(
        dlist: nixl_capi_reg_dlist_t,
        count: *mut usize,
    ) -> nixl_capi_status_t;

    /// Whether the list is empty.
    pub fn nixl_capi_reg_dlist_is_empty(
        dlist: nixl_capi_reg_dlist_t,
        is_empty: *mut bool,
    ) -> nixl_capi_status_t;

    /// Releases spare capacity.
    pub fn nixl_capi_reg_dlist_trim(dlist: nixl_capi_reg_dlist_t) -> nixl_capi_status_t;

    /// Removes descriptor `index`; out of range is an error status.
    pub fn nixl_capi_reg_dlist_rem_desc(
        dlist: nixl_capi_reg_dlist_t,
        index: c_int,
    ) -> nixl_capi_status_t;

    /// Removes every descriptor.
    pub fn nixl_capi_reg_dlist_clear(dlist: nixl_capi_reg_dlist_t) -> nixl_capi_status_t;

    /// Resizes to `new_size` descriptors (new ones are empty).
    pub fn nixl_capi_reg_dlist_resize(
        dlist: nixl_capi_reg_dlist_t,
        new_size: usize,
    ) -> nixl_capi_status_t;

    /// Prints the list to stdout (debugging).
    pub fn nixl_capi_reg_dlist_print(dlist: nixl_capi_reg_dlist_t) -> nixl_capi_status_t;

    // --- Transfer descriptor lists ------------------------------------------------------------

    /// Creates an empty transfer list of memory kind `mem_type`.
    pub fn nixl_capi_create_xfer_dlist(
        mem_type: nixl_capi_mem_type_t,
        dlist: *mut nixl_capi_xfer_dlist_t,
    ) -> nixl_capi_status_t;

    /// Frees a transfer list.
    pub fn nixl_capi_destroy_xfer_dlist(dlist: nixl_capi_xfer_dlist_t) -> nixl_capi_status_t;

    /// The list's memory kind.
    pub fn nixl_capi_xfer_dlist_get_type(
        dlist: nixl_capi_xfer_dlist_t,
        mem_type: *mut nixl_capi_mem_type_t,
    ) -> nixl_capi_status_t;

    /// Appends a descriptor: `len` bytes at `addr` on device `dev_id` (0 for host memory). For
    /// a remote list these are the peer's addresses, inside memory the peer registered.
    pub fn nixl_capi_xfer_dlist_add_desc(
        dlist: nixl_capi_xfer_dlist_t,
        addr: usize,
        len: usize,
        dev_id: u64,
    ) -> nixl_capi_status_t;

    /// Number of descriptors.
    pub fn nixl_capi_xfer_dlist_desc_count(
        dlist: nixl_capi_xfer_dlist_t,
        count: *mut usize,
    ) -> nixl_capi_status_t;

    /// Deprecated alias of [`nixl_capi_xfer_dlist_desc_count`].
    pub fn nixl_capi_xfer_dlist_len(
        dlist: nixl_capi_xfer_dlist_t,
        len: *mut usize,
    ) -> nixl_capi_status_t;

    /// Whether the list is empty.
    pub fn nixl_capi_xfer_dlist_is_empty(
        dlist: nixl_capi_xfer_dlist_t,
        is_empty: *mut bool,
    ) -> nixl_capi_status_t;

    /// Releases spare capacity.
    pub fn nixl_capi_xfer_dlist_trim(dlist: nixl_capi_xfer_dlist_t) -> nixl_capi_status_t;

    /// Removes descriptor `index`; out of range is an error status.
    pub fn nixl_capi_xfer_dlist_rem_desc(
        dlist: nixl_capi_xfer_dlist_t,
        index: c_int,
    ) -> nixl_capi_status_t;

    /// Removes every descriptor.
    pub fn nixl_capi_xfer_dlist_clear(dlist: nixl_capi_xfer_dlist_t) -> nixl_capi_status_t;

    /// Resizes to `new_size` descriptors (new ones are empty).
    pub fn nixl_capi_xfer_dlist_resize(
        dlist: nixl_capi_xfer_dlist_t,
        new_size: usize,
    ) -> nixl_capi_status_t;

    /// Prints the list to stdout (debugging).
    pub fn nixl_capi_xfer_dlist_print(dlist: nixl_capi_xfer_dlist_t) -> nixl_capi_status_t;

    // --- Remote descriptor lists and memory views ---------------------------------------------

    /// Creates an empty remote descriptor list of memory kind `mem_type`.
    pub fn nixl_capi_create_remote_dlist(
        mem_type: nixl_capi_mem_type_t,
        dlist: *mut nixl_capi_remote_dlist_t,
    ) -> nixl_capi_status_t;

    /// Frees a remote descriptor list.
    pub fn nixl_capi_destroy_remote_dlist(dlist: nixl_capi_remote_dlist_t) -> nixl_capi_status_t;

    /// Appends a descriptor of the peer `remote_agent` (copied; null stands for NIXL's
    /// placeholder agent, which keeps indices aligned).
    pub fn nixl_capi_remote_dlist_add_desc(
        dlist: nixl_capi_remote_dlist_t,
        addr: usize,
        len: usize,
        dev_id: u64,
        remote_agent: *const c_char,
    ) -> nixl_capi_status_t;

    /// Prepares a memory view of local registered buffers; release it with
    /// [`nixl_capi_release_mem_view`] before the agent goes.
    pub fn nixl_capi_prep_mem_view_local(
        agent: nixl_capi_agent_t,
        descs: nixl_capi_xfer_dlist_t,
        mvh: *mut nixl_capi_mem_view_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Prepares a memory view of remote buffers, possibly of several peers.
    pub fn nixl_capi_prep_mem_view_remote(
        agent: nixl_capi_agent_t,
        descs: nixl_capi_remote_dlist_t,
        mvh: *mut nixl_capi_mem_view_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Releases a memory view; a view of another agent is not reported (NIXL logs a warning).
    pub fn nixl_capi_release_mem_view(
        agent: nixl_capi_agent_t,
        mvh: nixl_capi_mem_view_t,
    ) -> nixl_capi_status_t;

    // --- Transfers ----------------------------------------------------------------------------

    /// Creates a transfer request between `local_descs` (registered on this agent) and
    /// `remote_descs` (registered on `remote_agent`, whose metadata is loaded): `operation` is
    /// [`NIXL_CAPI_XFER_OP_WRITE`] or [`NIXL_CAPI_XFER_OP_READ`]. The notification and backend
    /// choice come from `opt_args`.
    pub fn nixl_capi_create_xfer_req(
        agent: nixl_capi_agent_t,
        operation: nixl_capi_xfer_op_t,
        local_descs: nixl_capi_xfer_dlist_t,
        remote_descs: nixl_capi_xfer_dlist_t,
        remote_agent: *const c_char,
        req_hndl: *mut nixl_capi_xfer_req_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Prepares a descriptor list for repeated use with [`nixl_capi_make_xfer_req`]:
    /// `agent_name` is this agent's own name for a local list, the peer's for a remote one.
    pub fn nixl_capi_prep_xfer_dlist(
        agent: nixl_capi_agent_t,
        agent_name: *const c_char,
        descs: nixl_capi_xfer_dlist_t,
        dlist_hndl: *mut nixl_capi_xfer_dlist_handle_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Releases a prepared descriptor list and frees its handle.
    pub fn nixl_capi_release_xfer_dlist_handle(
        agent: nixl_capi_agent_t,
        dlist_handle: nixl_capi_xfer_dlist_handle_t,
    ) -> nixl_capi_status_t;

    /// Creates a transfer request from prepared lists, pairing `local_indices[i]` with
    /// `remote_indices[i]` (both arrays of the given counts, read during the call).
    pub fn nixl_capi_make_xfer_req(
        agent: nixl_capi_agent_t,
        operation: nixl_capi_xfer_op_t,
        local_descs: nixl_capi_xfer_dlist_handle_t,
        local_indices: *const c_int,
        local_indices_count: usize,
        remote_descs: nixl_capi_xfer_dlist_handle_t,
        remote_indices: *const c_int,
        remote_indices_count: usize,
        req_hndl: *mut nixl_capi_xfer_req_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Estimates how long the transfer will take, in microseconds, with an error margin.
    pub fn nixl_capi_estimate_xfer_cost(
        agent: nixl_capi_agent_t,
        req_hndl: nixl_capi_xfer_req_t,
        opt_args: nixl_capi_opt_args_t,
        duration_us: *mut i64,
        err_margin_us: *mut i64,
        method: *mut nixl_capi_cost_t,
    ) -> nixl_capi_status_t;

    /// Starts (or restarts, once complete) the transfer: [`NIXL_CAPI_SUCCESS`] if it already
    /// finished, [`NIXL_CAPI_IN_PROG`] if under way, negative on error. The local and remote
    /// memory must stay registered and untouched until it completes.
    pub fn nixl_capi_post_xfer_req(
        agent: nixl_capi_agent_t,
        req_hndl: nixl_capi_xfer_req_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Progresses the agent (when it has no progress thread) and reports the transfer's state:
    /// [`NIXL_CAPI_SUCCESS`] complete, [`NIXL_CAPI_IN_PROG`] under way, negative failed.
    pub fn nixl_capi_get_xfer_status(
        agent: nixl_capi_agent_t,
        req_hndl: nixl_capi_xfer_req_t,
    ) -> nixl_capi_status_t;

    /// The backend a transfer runs on, as a new handle (free it with
    /// [`nixl_capi_destroy_backend`]).
    pub fn nixl_capi_query_xfer_backend(
        agent: nixl_capi_agent_t,
        req_hndl: nixl_capi_xfer_req_t,
        backend: *mut nixl_capi_backend_t,
    ) -> nixl_capi_status_t;

    /// Fills caller-owned `telemetry` for a transfer; needs `capture_telemetry` (or NIXL's
    /// telemetry environment), else [`NIXL_CAPI_ERROR_NO_TELEMETRY`].
    pub fn nixl_capi_get_xfer_telemetry(
        agent: nixl_capi_agent_t,
        req_hndl: nixl_capi_xfer_req_t,
        telemetry: nixl_capi_xfer_telemetry_t,
    ) -> nixl_capi_status_t;

    /// Releases NIXL's side of a request. One still in progress is cancelled if the backend can;
    /// if it cannot, the call fails and the request stays alive. Follow with
    /// [`nixl_capi_destroy_xfer_req`].
    pub fn nixl_capi_release_xfer_req(
        agent: nixl_capi_agent_t,
        req: nixl_capi_xfer_req_t,
    ) -> nixl_capi_status_t;

    /// Frees a request handle already released with [`nixl_capi_release_xfer_req`];
    /// [`NIXL_CAPI_ERROR_INVALID_STATE`] (and nothing freed) otherwise.
    pub fn nixl_capi_destroy_xfer_req(req: nixl_capi_xfer_req_t) -> nixl_capi_status_t;

    // --- Notifications ----------------------------------------------------------------------

    /// Creates an empty notification map.
    pub fn nixl_capi_create_notif_map(notif_map: *mut nixl_capi_notif_map_t) -> nixl_capi_status_t;

    /// Frees a notification map.
    pub fn nixl_capi_destroy_notif_map(notif_map: nixl_capi_notif_map_t) -> nixl_capi_status_t;

    /// Progresses the agent and appends the notifications received since the last call to
    /// `notif_map`, grouped by sender name. Appends: clear the map first to see only new ones.
    pub fn nixl_capi_get_notifs(
        agent: nixl_capi_agent_t,
        notif_map: nixl_capi_notif_map_t,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Sends `len` bytes at `data` (copied) to a peer whose metadata is loaded, as a
    /// notification without a transfer.
    pub fn nixl_capi_gen_notif(
        agent: nixl_capi_agent_t,
        remote_agent: *const c_char,
        data: *const c_void,
        len: usize,
        opt_args: nixl_capi_opt_args_t,
    ) -> nixl_capi_status_t;

    /// Number of sender agents in the map.
    pub fn nixl_capi_notif_map_size(
        map: nixl_capi_notif_map_t,
        size: *mut usize,
    ) -> nixl_capi_status_t;

    /// Borrows the name of sender `index` (hash-map order, stable only while the map is
    /// unchanged); valid until the map is next changed.
    pub fn nixl_capi_notif_map_get_agent_at(
        map: nixl_capi_notif_map_t,
        index: usize,
        agent_name: *mut *const c_char,
    ) -> nixl_capi_status_t;

    /// Number of notifications from sender `agent_name`.
    pub fn nixl_capi_notif_map_get_notifs_size(
        map: nixl_capi_notif_map_t,
        agent_name: *const c_char,
        size: *mut usize,
    ) -> nixl_capi_status_t;

    /// Borrows notification `index` of sender `agent_name`: `*len` bytes at `*data`, not
    /// NUL-terminated, valid until the map is next changed.
    pub fn nixl_capi_notif_map_get_notif(
        map: nixl_capi_notif_map_t,
        agent_name: *const c_char,
        index: usize,
        data: *mut *const c_void,
        len: *mut usize,
    ) -> nixl_capi_status_t;

    /// Empties the map.
    pub fn nixl_capi_notif_map_clear(map: nixl_capi_notif_map_t) -> nixl_capi_status_t;
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{align_of, offset_of, size_of};

    // Expected values are what a C compiler lays out on an LP64 target (x86_64, aarch64), the
    // only targets NIXL ships for.

    #[test]
    fn agent_config_layout() {
        assert_eq!(size_of::<nixl_capi_agent_config_t>(), 40);
        assert_eq!(align_of::<nixl_capi_agent_config_t>(), 8);
        assert_eq!(offset_of!(nixl_capi_agent_config_s, enable_prog_thread), 0);
        assert_eq!(
            offset_of!(nixl_capi_agent_config_s, enable_listen_thread),
            1
        );
        assert_eq!(offset_of!(nixl_capi_agent_config_s, listen_port), 4);
        assert_eq!(offset_of!(nixl_capi_agent_config_s, thread_sync), 8);
        assert_eq!(offset_of!(nixl_capi_agent_config_s, num_workers), 12);
        assert_eq!(offset_of!(nixl_capi_agent_config_s, pthr_delay_us), 16);
        assert_eq!(offset_of!(nixl_capi_agent_config_s, lthr_delay_us), 24);
        assert_eq!(offset_of!(nixl_capi_agent_config_s, capture_telemetry), 32);
    }

    #[test]
    fn xfer_telemetry_layout() {
        assert_eq!(size_of::<nixl_capi_xfer_telemetry_s>(), 40);
        assert_eq!(align_of::<nixl_capi_xfer_telemetry_s>(), 8);
        assert_eq!(offset_of!(nixl_capi_xfer_telemetry_s, start_time_us), 0);
        assert_eq!(offset_of!(nixl_capi_xfer_telemetry_s, post_duration_us), 8);
        assert_eq!(offset_of!(nixl_capi_xfer_telemetry_s, xfer_duration_us), 16);
        assert_eq!(offset_of!(nixl_capi_xfer_telemetry_s, total_bytes), 24);
        assert_eq!(offset_of!(nixl_capi_xfer_telemetry_s, desc_count), 32);
    }

    #[test]
    fn c_enums_are_int_sized() {
        // GCC gives an enum with a negative member `int`, one without `unsigned int`.
        assert_eq!(size_of::<nixl_capi_status_t>(), 4);
        assert_eq!(size_of::<nixl_capi_mem_type_t>(), 4);
        assert_eq!(size_of::<nixl_capi_thread_sync_t>(), 4);
        assert_eq!(size_of::<nixl_capi_xfer_op_t>(), 4);
        assert_eq!(size_of::<nixl_capi_cost_t>(), 4);
    }

    #[test]
    fn build_script_dirs_are_absolute() {
        assert!(std::path::Path::new(LIB_DIR).is_absolute(), "{LIB_DIR}");
        assert!(
            std::path::Path::new(PLUGIN_DIR).is_absolute(),
            "{PLUGIN_DIR}"
        );
    }
}
