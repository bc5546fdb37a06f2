//! Real NIXL, real UCX plugin, two agents in one process talking over loopback.
//!
//! Nothing here is skipped: without NIXL the crate does not build. The agents run without
//! NIXL's progress thread, so every wait loop drives both of them itself.
//!
//! The tests do not set `NIXL_PLUGIN_DIR`: NIXL finds `PLUGIN_DIR` by itself (see the crate
//! docs), and `ucx_plugin_is_found_without_nixl_plugin_dir` checks exactly that. They share no
//! state and use distinct agent names, so they run in parallel under the default harness.

#![allow(clippy::unwrap_used)]

use nixl_sys as ffi;
use std::ffi::{CStr, CString, c_char, c_void};
use std::ptr;
use std::time::{Duration, Instant};

unsafe extern "C" {
    /// The C allocator's `free`, which releases the buffers and strings NIXL hands back
    /// (`malloc`/`strdup` inside libnixl_capi). Declared here to keep the crate dependency-free.
    fn free(ptr: *mut c_void);
}

const WAIT: Duration = Duration::from_secs(10);

/// Keeps UCX's EFA module out of this test process, as the engine does for its own (where rdma-core is
/// installed, the module NIXL's UCX plugin loads crashes the process at exit), unless `UCX_MODULES` is
/// set. UCX reads it when NIXL loads the plugin, so it is set before `main`, from the ELF initialisers.
#[used]
#[unsafe(link_section = ".init_array")]
static KEEP_EFA_OUT: extern "C" fn() = keep_efa_out;

extern "C" fn keep_efa_out() {
    if std::env::var_os("UCX_MODULES").is_none() {
        // SAFETY: the ELF initialisers run before `main`, when no other thread exists to read the
        // environment concurrently.
        unsafe { std::env::set_var("UCX_MODULES", "^efa") };
    }
}

#[track_caller]
fn ok(status: ffi::nixl_capi_status_t, what: &str) {
    assert_eq!(
        status,
        ffi::NIXL_CAPI_SUCCESS,
        "{what} returned status {status}"
    );
}

fn agent_config() -> ffi::nixl_capi_agent_config_t {
    ffi::nixl_capi_agent_config_t {
        // Off: on a small machine the thread halves throughput, and the engine polls anyway.
        enable_prog_thread: false,
        enable_listen_thread: false,
        listen_port: 0,
        thread_sync: ffi::NIXL_CAPI_THREAD_SYNC_NONE,
        num_workers: 1,
        pthr_delay_us: 0,
        lthr_delay_us: 100_000,
        capture_telemetry: false,
    }
}

/// An agent with the UCX backend; destroyed on drop.
struct Agent {
    raw: ffi::nixl_capi_agent_t,
    backend: ffi::nixl_capi_backend_t,
    name: CString,
}

impl Agent {
    fn bare(name: &str) -> Agent {
        let name = CString::new(name).unwrap();
        let cfg = agent_config();
        let mut raw = ptr::null_mut();
        // SAFETY: `name` and `cfg` are live for the call and copied by it; `raw` is a live local.
        ok(
            unsafe { ffi::nixl_capi_create_configured_agent(name.as_ptr(), &cfg, &mut raw) },
            "create_configured_agent",
        );
        assert!(!raw.is_null());
        Agent {
            raw,
            backend: ptr::null_mut(),
            name,
        }
    }

    fn with_ucx(name: &str) -> Agent {
        let mut agent = Agent::bare(name);
        let (mems, params) = plugin_params(&agent, c"UCX");
        let mut backend = ptr::null_mut();
        // SAFETY: `agent.raw` is a live agent; `params` came from get_plugin_params and is only
        // read (copied) by create_backend; `backend` is a live local.
        ok(
            unsafe {
                ffi::nixl_capi_create_backend(agent.raw, c"UCX".as_ptr(), params, &mut backend)
            },
            "create_backend(UCX)",
        );
        // SAFETY: both were returned by get_plugin_params, are not used again and are destroyed
        // once each.
        unsafe {
            ok(ffi::nixl_capi_destroy_params(params), "destroy_params");
            ok(ffi::nixl_capi_destroy_mem_list(mems), "destroy_mem_list");
        }
        agent.backend = backend;
        agent
    }

    /// Drives the agent's backends once and moves what arrived into `map` (after clearing it).
    fn poll_notifs(&self, map: ffi::nixl_capi_notif_map_t) {
        // SAFETY: `self.raw` and `map` are live handles owned by this test thread; a null
        // opt_args means "all backends".
        unsafe {
            ok(ffi::nixl_capi_notif_map_clear(map), "notif_map_clear");
            ok(
                ffi::nixl_capi_get_notifs(self.raw, map, ptr::null_mut()),
                "get_notifs",
            );
        }
    }

    /// Optional arguments naming this agent's UCX backend; destroyed by the caller.
    fn opt_args(&self) -> ffi::nixl_capi_opt_args_t {
        let mut args = ptr::null_mut();
        // SAFETY: `args` is a live local; `self.backend` is this agent's live backend handle,
        // which outlives the returned arguments in every test.
        unsafe {
            ok(ffi::nixl_capi_create_opt_args(&mut args), "create_opt_args");
            ok(
                ffi::nixl_capi_opt_args_add_backend(args, self.backend),
                "opt_args_add_backend",
            );
        }
        args
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // SAFETY: both handles were created by this value and are destroyed exactly once, here,
        // backend handle first (it only frees the handle; the backend goes with the agent).
        let (b, a) = unsafe {
            let b = if self.backend.is_null() {
                ffi::NIXL_CAPI_SUCCESS
            } else {
                ffi::nixl_capi_destroy_backend(self.backend)
            };
            (b, ffi::nixl_capi_destroy_agent(self.raw))
        };
        if !std::thread::panicking() {
            ok(b, "destroy_backend");
            ok(a, "destroy_agent");
        }
    }
}

fn plugin_params(
    agent: &Agent,
    plugin: &CStr,
) -> (ffi::nixl_capi_mem_list_t, ffi::nixl_capi_params_t) {
    let (mut mems, mut params) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: `agent.raw` is live, `plugin` is NUL-terminated, the out pointers are live locals.
    ok(
        unsafe {
            ffi::nixl_capi_get_plugin_params(agent.raw, plugin.as_ptr(), &mut mems, &mut params)
        },
        "get_plugin_params",
    );
    (mems, params)
}

/// A DRAM registration list of one buffer; destroyed by the caller.
fn dram_reg_list(buf: *const u8, len: usize) -> ffi::nixl_capi_reg_dlist_t {
    let mut dlist = ptr::null_mut();
    // SAFETY: `dlist` is a live local; add_desc only records the address, it does not touch it.
    unsafe {
        ok(
            ffi::nixl_capi_create_reg_dlist(ffi::NIXL_CAPI_MEM_DRAM, &mut dlist),
            "create_reg_dlist",
        );
        ok(
            ffi::nixl_capi_reg_dlist_add_desc(dlist, buf as usize, len, 0, ptr::null(), 0),
            "reg_dlist_add_desc",
        );
    }
    dlist
}

/// A DRAM transfer list of one buffer; destroyed by the caller.
fn dram_xfer_list(addr: usize, len: usize) -> ffi::nixl_capi_xfer_dlist_t {
    let mut dlist = ptr::null_mut();
    // SAFETY: `dlist` is a live local; add_desc only records the address.
    unsafe {
        ok(
            ffi::nixl_capi_create_xfer_dlist(ffi::NIXL_CAPI_MEM_DRAM, &mut dlist),
            "create_xfer_dlist",
        );
        ok(
            ffi::nixl_capi_xfer_dlist_add_desc(dlist, addr, len, 0),
            "xfer_dlist_add_desc",
        );
    }
    dlist
}

/// Copies a NUL-terminated string NIXL lent us.
///
/// # Safety
/// `s` is non-null and points to a NUL-terminated string valid for the duration of the call.
unsafe fn lent_str(s: *const c_char) -> String {
    assert!(!s.is_null());
    // SAFETY: the caller promises a valid NUL-terminated string.
    unsafe { CStr::from_ptr(s) }.to_str().unwrap().to_owned()
}

#[test]
fn ucx_plugin_is_found_without_nixl_plugin_dir() {
    // NIXL prefers the variable when set; then this checks the user's folder instead.
    if let Some(dir) = std::env::var_os(ffi::NIXL_PLUGIN_DIR_ENV) {
        eprintln!(
            "{} is set ({}): checking that folder, not NIXL's default",
            ffi::NIXL_PLUGIN_DIR_ENV,
            dir.display()
        );
    }
    let agent = Agent::bare("discovery");
    let mut list = ptr::null_mut();
    let mut n = 0;
    let mut names = Vec::new();
    // SAFETY: `agent.raw` is live; `list` is created here and destroyed once below, and every
    // string borrowed from it is copied before that.
    unsafe {
        ok(
            ffi::nixl_capi_get_available_plugins(agent.raw, &mut list),
            "get_available_plugins",
        );
        ok(
            ffi::nixl_capi_string_list_size(list, &mut n),
            "string_list_size",
        );
        for i in 0..n {
            let mut s = ptr::null();
            ok(
                ffi::nixl_capi_string_list_get(list, i, &mut s),
                "string_list_get",
            );
            names.push(lent_str(s));
        }
        let mut s = ptr::null();
        assert_eq!(
            ffi::nixl_capi_string_list_get(list, n, &mut s),
            ffi::NIXL_CAPI_ERROR_INVALID_PARAM,
            "index past the end"
        );
        ok(
            ffi::nixl_capi_destroy_string_list(list),
            "destroy_string_list",
        );
    }
    assert!(
        names.iter().any(|n| n == "UCX"),
        "plugins found in {}: {names:?}",
        ffi::PLUGIN_DIR
    );

    // The UCX plugin's defaults: it handles host memory, and its parameters iterate.
    let (mems, params) = plugin_params(&agent, c"UCX");
    let mut kinds = Vec::new();
    let mut entries = Vec::new();
    // SAFETY: `mems` and `params` come from get_plugin_params and are destroyed once below; the
    // iterator is destroyed before `params`, and each borrowed key/value is copied before the next
    // iterator call.
    unsafe {
        let mut len = 0;
        ok(
            ffi::nixl_capi_mem_list_size(mems, &mut len),
            "mem_list_size",
        );
        for i in 0..len {
            let mut kind = ffi::NIXL_CAPI_MEM_UNKNOWN;
            ok(
                ffi::nixl_capi_mem_list_get(mems, i, &mut kind),
                "mem_list_get",
            );
            kinds.push(kind);
        }
        let mut empty = true;
        ok(
            ffi::nixl_capi_params_is_empty(params, &mut empty),
            "params_is_empty",
        );
        if !empty {
            let mut iter = ptr::null_mut();
            ok(
                ffi::nixl_capi_params_create_iterator(params, &mut iter),
                "params_create_iterator",
            );
            loop {
                let (mut k, mut v, mut more) = (ptr::null(), ptr::null(), false);
                ok(
                    ffi::nixl_capi_params_iterator_next(iter, &mut k, &mut v, &mut more),
                    "iterator_next",
                );
                entries.push((lent_str(k), lent_str(v)));
                if !more {
                    break;
                }
            }
            ok(
                ffi::nixl_capi_params_destroy_iterator(iter),
                "params_destroy_iterator",
            );
        }
        ok(ffi::nixl_capi_destroy_params(params), "destroy_params");
        ok(ffi::nixl_capi_destroy_mem_list(mems), "destroy_mem_list");
    }
    assert!(
        kinds.contains(&ffi::NIXL_CAPI_MEM_DRAM),
        "UCX memory kinds: {kinds:?}"
    );
    assert!(!entries.is_empty(), "UCX has default parameters");
}

#[test]
fn write_with_notification_between_two_agents() {
    const LEN: usize = 1 << 20;
    let target = Agent::with_ucx("loopback-target");
    let initiator = Agent::with_ucx("loopback-initiator");

    let src: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; LEN];
    let dst_addr = dst.as_mut_ptr() as usize;

    // Register both buffers, each with its own agent.
    let src_reg = dram_reg_list(src.as_ptr(), LEN);
    let dst_reg = dram_reg_list(dst.as_mut_ptr(), LEN);
    let (i_args, t_args) = (initiator.opt_args(), target.opt_args());
    // SAFETY: both buffers outlive their registrations (deregistered below, before they drop),
    // and neither is touched from Rust while registered except to read `dst` after the transfer
    // is complete.
    unsafe {
        ok(
            ffi::nixl_capi_register_mem(initiator.raw, src_reg, i_args),
            "register_mem(src)",
        );
        ok(
            ffi::nixl_capi_register_mem(target.raw, dst_reg, t_args),
            "register_mem(dst)",
        );
    }

    // Metadata: the initiator loads the target's.
    let (mut md, mut md_len) = (ptr::null_mut(), 0);
    let mut peer = ptr::null_mut();
    // SAFETY: `md` is malloc'd by get_local_md and freed once here after load_remote_md copied
    // it; `peer` is strdup'd by load_remote_md and freed once after being copied.
    let peer_name = unsafe {
        ok(
            ffi::nixl_capi_get_local_md(target.raw, &mut md, &mut md_len),
            "get_local_md",
        );
        assert!(!md.is_null() && md_len > 0);
        let status = ffi::nixl_capi_load_remote_md(initiator.raw, md, md_len, &mut peer);
        free(md);
        ok(status, "load_remote_md");
        let name = lent_str(peer);
        free(peer.cast());
        name
    };
    assert_eq!(peer_name, target.name.to_str().unwrap());
    // SAFETY: live agent, NUL-terminated name; null descs asks only whether metadata is loaded.
    ok(
        unsafe {
            ffi::nixl_capi_check_remote_md(initiator.raw, target.name.as_ptr(), ptr::null_mut())
        },
        "check_remote_md",
    );

    // The write, carrying a notification.
    let msg: &[u8] = b"chunk 7 of request 42 \x00 with a NUL inside";
    let local = dram_xfer_list(src.as_ptr() as usize, LEN);
    let remote = dram_xfer_list(dst_addr, LEN);
    let xfer_args = initiator.opt_args();
    let mut req = ptr::null_mut();
    // SAFETY: all handles are live; `msg` is copied by set_notif_msg; `req` is a live local.
    let posted = unsafe {
        ok(
            ffi::nixl_capi_opt_args_set_notif_msg(xfer_args, msg.as_ptr().cast(), msg.len()),
            "set_notif_msg",
        );
        ok(
            ffi::nixl_capi_opt_args_set_has_notif(xfer_args, true),
            "set_has_notif",
        );
        ok(
            ffi::nixl_capi_create_xfer_req(
                initiator.raw,
                ffi::NIXL_CAPI_XFER_OP_WRITE,
                local,
                remote,
                target.name.as_ptr(),
                &mut req,
                xfer_args,
            ),
            "create_xfer_req",
        );
        ffi::nixl_capi_post_xfer_req(initiator.raw, req, ptr::null_mut())
    };
    assert!(
        posted == ffi::NIXL_CAPI_SUCCESS || posted == ffi::NIXL_CAPI_IN_PROG,
        "post_xfer_req returned {posted}"
    );

    // Poll both agents until the write is complete and the notification has arrived.
    let mut map = ptr::null_mut();
    let mut scratch = ptr::null_mut();
    // SAFETY: live locals; both maps are destroyed once below.
    unsafe {
        ok(
            ffi::nixl_capi_create_notif_map(&mut map),
            "create_notif_map",
        );
        ok(
            ffi::nixl_capi_create_notif_map(&mut scratch),
            "create_notif_map",
        );
    }
    let deadline = Instant::now() + WAIT;
    let mut done = posted == ffi::NIXL_CAPI_SUCCESS;
    let mut received = Vec::new();
    loop {
        if !done {
            // SAFETY: `req` is a live request of `initiator`.
            match unsafe { ffi::nixl_capi_get_xfer_status(initiator.raw, req) } {
                ffi::NIXL_CAPI_SUCCESS => done = true,
                ffi::NIXL_CAPI_IN_PROG => {}
                status => panic!("transfer failed with status {status}"),
            }
        }
        // The initiator must be driven too, or its side of the connection and the notification
        // never leave; it receives nothing itself.
        initiator.poll_notifs(scratch);
        target.poll_notifs(map);
        received.extend(notifications(map));
        if done && !received.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no completion within {WAIT:?}: transfer done = {done}, notifications = {received:?}"
        );
        std::thread::yield_now();
    }

    assert_eq!(
        received,
        vec![(initiator.name.to_str().unwrap().to_owned(), msg.to_vec())]
    );
    assert!(dst == src, "destination bytes differ from the source");

    // Teardown, checking every status.
    // SAFETY: every handle below is live and released exactly once, the request first (it is
    // complete, so release cancels nothing), registrations before their buffers drop.
    unsafe {
        assert_eq!(
            ffi::nixl_capi_destroy_xfer_req(req),
            ffi::NIXL_CAPI_ERROR_INVALID_STATE,
            "destroying an unreleased request is refused"
        );
        ok(
            ffi::nixl_capi_release_xfer_req(initiator.raw, req),
            "release_xfer_req",
        );
        ok(ffi::nixl_capi_destroy_xfer_req(req), "destroy_xfer_req");
        ok(ffi::nixl_capi_destroy_notif_map(map), "destroy_notif_map");
        ok(
            ffi::nixl_capi_destroy_notif_map(scratch),
            "destroy_notif_map",
        );
        ok(
            ffi::nixl_capi_destroy_opt_args(xfer_args),
            "destroy_opt_args",
        );
        ok(
            ffi::nixl_capi_destroy_xfer_dlist(local),
            "destroy_xfer_dlist",
        );
        ok(
            ffi::nixl_capi_destroy_xfer_dlist(remote),
            "destroy_xfer_dlist",
        );
        ok(
            ffi::nixl_capi_invalidate_remote_md(initiator.raw, target.name.as_ptr()),
            "invalidate_remote_md",
        );
        assert_eq!(
            ffi::nixl_capi_check_remote_md(initiator.raw, target.name.as_ptr(), ptr::null_mut()),
            ffi::NIXL_CAPI_ERROR_NOT_FOUND,
            "metadata is gone after invalidation"
        );
        ok(
            ffi::nixl_capi_deregister_mem(initiator.raw, src_reg, i_args),
            "deregister_mem(src)",
        );
        ok(
            ffi::nixl_capi_deregister_mem(target.raw, dst_reg, t_args),
            "deregister_mem(dst)",
        );
        ok(
            ffi::nixl_capi_destroy_reg_dlist(src_reg),
            "destroy_reg_dlist",
        );
        ok(
            ffi::nixl_capi_destroy_reg_dlist(dst_reg),
            "destroy_reg_dlist",
        );
        ok(ffi::nixl_capi_destroy_opt_args(i_args), "destroy_opt_args");
        ok(ffi::nixl_capi_destroy_opt_args(t_args), "destroy_opt_args");
    }
    drop(initiator);
    drop(target);
}

/// Copies every (sender, message) pair out of a notification map.
fn notifications(map: ffi::nixl_capi_notif_map_t) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    // SAFETY: `map` is live and not changed during this function, so every name and message
    // borrowed from it stays valid until copied.
    unsafe {
        let mut agents = 0;
        ok(
            ffi::nixl_capi_notif_map_size(map, &mut agents),
            "notif_map_size",
        );
        for a in 0..agents {
            let mut name = ptr::null();
            ok(
                ffi::nixl_capi_notif_map_get_agent_at(map, a, &mut name),
                "notif_map_get_agent_at",
            );
            let mut count = 0;
            ok(
                ffi::nixl_capi_notif_map_get_notifs_size(map, name, &mut count),
                "get_notifs_size",
            );
            for i in 0..count {
                let (mut data, mut len) = (ptr::null(), 0);
                ok(
                    ffi::nixl_capi_notif_map_get_notif(map, name, i, &mut data, &mut len),
                    "get_notif",
                );
                let bytes = if len == 0 {
                    Vec::new()
                } else {
                    std::slice::from_raw_parts(data.cast::<u8>(), len).to_vec()
                };
                out.push((lent_str(name), bytes));
            }
        }
    }
    out
}

#[test]
fn garbage_metadata_is_rejected() {
    let agent = Agent::with_ucx("garbage-loader");
    let garbage = b"this is not NIXL metadata";
    let mut name: *mut c_char = ptr::null_mut();
    // SAFETY: live agent; `garbage` is readable for its length and only read; `name` is a local.
    let status = unsafe {
        ffi::nixl_capi_load_remote_md(agent.raw, garbage.as_ptr().cast(), garbage.len(), &mut name)
    };
    // NIXL's deserialisation error is one of those the C layer folds into ERROR_BACKEND.
    assert_eq!(
        status,
        ffi::NIXL_CAPI_ERROR_BACKEND,
        "loading garbage metadata"
    );
    assert!(name.is_null(), "no name is returned on failure");

    // An agent nobody loaded is not found, and naming it in a transfer fails without a request.
    let local = dram_xfer_list(0x1000, 16);
    let remote = dram_xfer_list(0x2000, 16);
    let mut req = ptr::null_mut();
    // SAFETY: live handles and NUL-terminated names; the lists are destroyed once below; no
    // memory is touched because the request is refused.
    unsafe {
        assert_eq!(
            ffi::nixl_capi_check_remote_md(agent.raw, c"nobody".as_ptr(), ptr::null_mut()),
            ffi::NIXL_CAPI_ERROR_NOT_FOUND
        );
        let status = ffi::nixl_capi_create_xfer_req(
            agent.raw,
            ffi::NIXL_CAPI_XFER_OP_WRITE,
            local,
            remote,
            c"nobody".as_ptr(),
            &mut req,
            ptr::null_mut(),
        );
        assert!(status < 0, "transfer to an unknown agent returned {status}");
        assert!(req.is_null());
        ok(
            ffi::nixl_capi_destroy_xfer_dlist(local),
            "destroy_xfer_dlist",
        );
        ok(
            ffi::nixl_capi_destroy_xfer_dlist(remote),
            "destroy_xfer_dlist",
        );
    }
}

#[test]
fn status_codes_and_constants_of_the_c_layer() {
    // SAFETY: each call gets null handles, which the C layer checks before use, or live locals.
    unsafe {
        assert!(!ffi::nixl_capi_is_stub());
        assert_eq!(
            ffi::nixl_capi_destroy_agent(ptr::null_mut()),
            ffi::NIXL_CAPI_ERROR_INVALID_PARAM
        );
        assert_eq!(
            ffi::nixl_capi_get_xfer_status(ptr::null_mut(), ptr::null_mut()),
            ffi::NIXL_CAPI_ERROR_INVALID_PARAM
        );
        let cfg = agent_config();
        let mut agent = ptr::null_mut();
        assert_eq!(
            ffi::nixl_capi_create_configured_agent(ptr::null(), &cfg, &mut agent),
            ffi::NIXL_CAPI_ERROR_INVALID_PARAM
        );
        assert!(agent.is_null());

        // The memory-kind numbers agree with the library's own names for them.
        for (kind, name) in [
            (ffi::NIXL_CAPI_MEM_DRAM, "DRAM"),
            (ffi::NIXL_CAPI_MEM_VRAM, "VRAM"),
            (ffi::NIXL_CAPI_MEM_BLOCK, "BLOCK"),
            (ffi::NIXL_CAPI_MEM_OBJECT, "OBJECT"),
            (ffi::NIXL_CAPI_MEM_FILE, "FILE"),
            (ffi::NIXL_CAPI_MEM_UNKNOWN, "UNKNOWN"),
        ] {
            let mut s = ptr::null();
            ok(
                ffi::nixl_capi_mem_type_to_string(kind, &mut s),
                "mem_type_to_string",
            );
            assert_eq!(lent_str(s), name);
        }
        let mut s = ptr::null();
        assert_eq!(
            ffi::nixl_capi_mem_type_to_string(6, &mut s),
            ffi::NIXL_CAPI_ERROR_INVALID_PARAM
        );

        // A VRAM list keeps its kind, and a descriptor list counts what was added.
        let mut dlist = ptr::null_mut();
        ok(
            ffi::nixl_capi_create_reg_dlist(ffi::NIXL_CAPI_MEM_VRAM, &mut dlist),
            "create_reg_dlist",
        );
        let mut kind = ffi::NIXL_CAPI_MEM_UNKNOWN;
        ok(
            ffi::nixl_capi_reg_dlist_get_type(dlist, &mut kind),
            "reg_dlist_get_type",
        );
        assert_eq!(kind, ffi::NIXL_CAPI_MEM_VRAM);
        ok(
            ffi::nixl_capi_reg_dlist_add_desc(dlist, 0x1000, 64, 3, ptr::null(), 0),
            "add_desc",
        );
        let mut count = 0;
        ok(
            ffi::nixl_capi_reg_dlist_desc_count(dlist, &mut count),
            "desc_count",
        );
        assert_eq!(count, 1);
        ok(ffi::nixl_capi_destroy_reg_dlist(dlist), "destroy_reg_dlist");

        // Option arguments round-trip the notification bytes through a malloc'd copy.
        let mut args = ptr::null_mut();
        ok(ffi::nixl_capi_create_opt_args(&mut args), "create_opt_args");
        ok(
            ffi::nixl_capi_opt_args_set_notif_msg(args, b"hi".as_ptr().cast(), 2),
            "set_notif_msg",
        );
        let mut has = true;
        ok(
            ffi::nixl_capi_opt_args_get_has_notif(args, &mut has),
            "get_has_notif",
        );
        assert!(!has, "a message alone does not turn notification on");
        let (mut data, mut len) = (ptr::null_mut(), 0);
        ok(
            ffi::nixl_capi_opt_args_get_notif_msg(args, &mut data, &mut len),
            "get_notif_msg",
        );
        assert_eq!(std::slice::from_raw_parts(data.cast::<u8>(), len), b"hi");
        free(data);
        ok(ffi::nixl_capi_destroy_opt_args(args), "destroy_opt_args");
    }
}
