//! The raw bindings against the real UCX library: context and worker, memory mapping, rkeys, a put
//! from one worker to another and an active message, all in one process over loopback transports.
#![allow(clippy::unwrap_used, clippy::undocumented_unsafe_blocks)]

use std::ffi::{CStr, c_void};
use std::ptr;
use std::time::{Duration, Instant};
use ucx_sys as ffi;

const BOUND: Duration = Duration::from_secs(10);

fn check(status: ffi::ucs_status_t, what: &str) {
    if !status.is_ok() {
        let msg = unsafe { CStr::from_ptr(ffi::ucs_status_string(status)) };
        panic!("{what}: {} ({})", msg.to_string_lossy(), status.0);
    }
}

struct Context(ffi::ucp_context_h);

/// Keeps UCX's EFA module out of this test process, as the engine does for its own (where rdma-core
/// is installed, that module crashes the process at exit), unless `UCX_MODULES` is set.
fn keep_efa_out() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("UCX_MODULES").is_none() {
            check(
                unsafe { ffi::ucs_global_opts_set_value(c"MODULES".as_ptr(), c"^efa".as_ptr()) },
                "ucs_global_opts_set_value",
            );
        }
    });
}

impl Context {
    fn new() -> Self {
        keep_efa_out();
        let params = ffi::ucp_params_t {
            field_mask: ffi::ucp_params_field::UCP_PARAM_FIELD_FEATURES.0 as u64,
            features: (ffi::ucp_feature::UCP_FEATURE_RMA | ffi::ucp_feature::UCP_FEATURE_AM).0
                as u64,
            ..Default::default()
        };
        let mut ctx = ptr::null_mut();
        check(
            unsafe { ffi::kvx_ucp_init(&params, ptr::null(), &mut ctx) },
            "ucp_init",
        );
        Context(ctx)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        unsafe { ffi::ucp_cleanup(self.0) };
    }
}

struct Worker(ffi::ucp_worker_h);

impl Worker {
    fn new(ctx: &Context) -> Self {
        let params = ffi::ucp_worker_params_t {
            field_mask: ffi::ucp_worker_params_field::UCP_WORKER_PARAM_FIELD_THREAD_MODE.0 as u64,
            thread_mode: ffi::ucs_thread_mode_t::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut w = ptr::null_mut();
        check(
            unsafe { ffi::ucp_worker_create(ctx.0, &params, &mut w) },
            "ucp_worker_create",
        );
        Worker(w)
    }

    fn address(&self) -> Vec<u8> {
        let mut addr = ptr::null_mut();
        let mut len = 0usize;
        check(
            unsafe { ffi::ucp_worker_get_address(self.0, &mut addr, &mut len) },
            "get_address",
        );
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        unsafe { ffi::ucp_worker_release_address(self.0, addr) };
        bytes
    }

    fn connect(&self, remote: &[u8]) -> ffi::ucp_ep_h {
        let params = ffi::ucp_ep_params_t {
            field_mask: ffi::ucp_ep_params_field::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS.0 as u64,
            address: remote.as_ptr() as *const ffi::ucp_address_t,
            ..Default::default()
        };
        let mut ep = ptr::null_mut();
        check(
            unsafe { ffi::ucp_ep_create(self.0, &params, &mut ep) },
            "ucp_ep_create",
        );
        ep
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        unsafe { ffi::ucp_worker_destroy(self.0) };
    }
}

/// Progresses both workers until `request` (a `ucs_status_ptr_t`) is done, within the bound.
fn wait(req: ffi::ucs_status_ptr_t, workers: &[&Worker], what: &str) {
    if unsafe { ffi::kvx_ucs_ptr_is_err(req) } != 0 {
        check(unsafe { ffi::kvx_ucs_ptr_raw_status(req) }, what);
    }
    if req.is_null() {
        return;
    }
    let deadline = Instant::now() + BOUND;
    loop {
        for w in workers {
            unsafe { ffi::ucp_worker_progress(w.0) };
        }
        let st = unsafe { ffi::ucp_request_check_status(req) };
        if st != ffi::ucs_status_t::UCS_INPROGRESS {
            unsafe { ffi::ucp_request_free(req) };
            check(st, what);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not finish within {BOUND:?}"
        );
    }
}

fn close(ep: ffi::ucp_ep_h, workers: &[&Worker]) {
    // A flushing close: FORCE is only valid with peer error handling.
    let param = ffi::ucp_request_param_t::default();
    let req = unsafe { ffi::ucp_ep_close_nbx(ep, &param) };
    wait(req, workers, "ucp_ep_close_nbx");
}

#[test]
fn version_of_headers_and_library() {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    unsafe { ffi::ucp_get_version(&mut major, &mut minor, &mut release) };
    let (mut hmaj, mut hmin) = (0, 0);
    unsafe { ffi::kvx_ucp_api_version(&mut hmaj, &mut hmin) };
    println!("UCX library {major}.{minor}.{release}, headers {hmaj}.{hmin}");
    assert_eq!(major, hmaj);
    assert!(
        minor >= hmin,
        "library {major}.{minor} older than headers {hmaj}.{hmin}"
    );
}

#[test]
fn context_and_worker() {
    let ctx = Context::new();
    let w = Worker::new(&ctx);
    assert!(!w.address().is_empty());
    let mut attr = ffi::ucp_worker_attr_t {
        field_mask: ffi::ucp_worker_attr_field::UCP_WORKER_ATTR_FIELD_THREAD_MODE.0 as u64,
        ..Default::default()
    };
    check(
        unsafe { ffi::ucp_worker_query(w.0, &mut attr) },
        "ucp_worker_query",
    );
    assert_eq!(
        attr.thread_mode,
        ffi::ucs_thread_mode_t::UCS_THREAD_MODE_SINGLE
    );
}

/// Maps `buf`, packs its rkey; returns (memh, packed rkey bytes).
fn map(ctx: &Context, buf: &mut [u8]) -> (ffi::ucp_mem_h, Vec<u8>) {
    let params = ffi::ucp_mem_map_params_t {
        field_mask: (ffi::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | ffi::ucp_mem_map_params_field::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
            .0 as u64,
        address: buf.as_mut_ptr() as *mut c_void,
        length: buf.len(),
        ..Default::default()
    };
    let mut memh = ptr::null_mut();
    check(
        unsafe { ffi::ucp_mem_map(ctx.0, &params, &mut memh) },
        "ucp_mem_map",
    );
    let mut rkey_buf = ptr::null_mut();
    let mut rkey_len = 0usize;
    check(
        unsafe { ffi::ucp_rkey_pack(ctx.0, memh, &mut rkey_buf, &mut rkey_len) },
        "ucp_rkey_pack",
    );
    let packed = unsafe { std::slice::from_raw_parts(rkey_buf as *const u8, rkey_len) }.to_vec();
    unsafe { ffi::ucp_rkey_buffer_release(rkey_buf) };
    (memh, packed)
}

#[test]
fn put_between_two_workers() {
    let ctx = Context::new();
    let (a, b) = (Worker::new(&ctx), Worker::new(&ctx));
    let ep = a.connect(&b.address());

    let len = 1 << 20;
    let mut src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let mut dst = vec![0u8; len];
    let (src_memh, _) = map(&ctx, &mut src);
    let (dst_memh, packed) = map(&ctx, &mut dst);

    let mut rkey = ptr::null_mut();
    check(
        unsafe { ffi::ucp_ep_rkey_unpack(ep, packed.as_ptr() as *const c_void, &mut rkey) },
        "ucp_ep_rkey_unpack",
    );

    let param = ffi::ucp_request_param_t {
        op_attr_mask: ffi::ucp_op_attr_t::UCP_OP_ATTR_FIELD_MEMH.0,
        memh: src_memh,
        ..Default::default()
    };
    // Two puts at different offsets, then a flush makes both remotely complete.
    let half = len / 2;
    for off in [0, half] {
        let req = unsafe {
            ffi::ucp_put_nbx(
                ep,
                src.as_ptr().add(off) as *const c_void,
                half,
                dst.as_ptr() as u64 + off as u64,
                rkey,
                &param,
            )
        };
        wait(req, &[&a, &b], "ucp_put_nbx");
    }
    let flush = ffi::ucp_request_param_t::default();
    wait(
        unsafe { ffi::ucp_ep_flush_nbx(ep, &flush) },
        &[&a, &b],
        "ucp_ep_flush_nbx",
    );
    assert!(
        src == dst,
        "destination differs from source after put and flush"
    );

    unsafe { ffi::ucp_rkey_destroy(rkey) };
    close(ep, &[&a, &b]);
    check(unsafe { ffi::ucp_mem_unmap(ctx.0, src_memh) }, "unmap src");
    check(unsafe { ffi::ucp_mem_unmap(ctx.0, dst_memh) }, "unmap dst");
}

#[derive(Default)]
struct Received {
    header: Vec<u8>,
    data: Vec<u8>,
    count: usize,
}

unsafe extern "C" fn on_am(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    _param: *const ffi::ucp_am_recv_param_t,
) -> ffi::ucs_status_t {
    let got = unsafe { &mut *(arg as *mut Received) };
    got.header = unsafe { std::slice::from_raw_parts(header as *const u8, header_length) }.to_vec();
    got.data = unsafe { std::slice::from_raw_parts(data as *const u8, length) }.to_vec();
    got.count += 1;
    ffi::ucs_status_t::UCS_OK
}

#[test]
fn active_message_between_two_workers() {
    let ctx = Context::new();
    let (a, b) = (Worker::new(&ctx), Worker::new(&ctx));
    // UCX writes through this pointer from inside ucp_worker_progress; we read it only through the
    // same pointer, so no Rust reference is alive across those writes.
    let got_ptr = Box::into_raw(Box::new(Received::default()));
    let handler = ffi::ucp_am_handler_param_t {
        field_mask: (ffi::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ID
            | ffi::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_CB
            | ffi::ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ARG)
            .0 as u64,
        id: 7,
        cb: Some(on_am),
        arg: got_ptr as *mut c_void,
        ..Default::default()
    };
    check(
        unsafe { ffi::ucp_worker_set_am_recv_handler(b.0, &handler) },
        "set_am_recv_handler",
    );
    let ep = a.connect(&b.address());

    let header = *b"hdr-0001";
    let payload: Vec<u8> = (0..300u32).map(|i| (i % 256) as u8).collect();
    let param = ffi::ucp_request_param_t {
        op_attr_mask: ffi::ucp_op_attr_t::UCP_OP_ATTR_FIELD_FLAGS.0,
        flags: ffi::ucp_send_am_flags::UCP_AM_SEND_FLAG_EAGER.0,
        ..Default::default()
    };
    let req = unsafe {
        ffi::ucp_am_send_nbx(
            ep,
            7,
            header.as_ptr() as *const c_void,
            header.len(),
            payload.as_ptr() as *const c_void,
            payload.len(),
            &param,
        )
    };
    wait(req, &[&a, &b], "ucp_am_send_nbx");
    let deadline = Instant::now() + BOUND;
    // The count changes inside ucp_worker_progress, which clippy cannot see.
    #[allow(clippy::while_immutable_condition)]
    while unsafe { (*got_ptr).count } == 0 {
        unsafe { ffi::ucp_worker_progress(a.0) };
        unsafe { ffi::ucp_worker_progress(b.0) };
        assert!(
            Instant::now() < deadline,
            "active message not received within {BOUND:?}"
        );
    }
    let got = unsafe { Box::from_raw(got_ptr) };
    assert_eq!(got.count, 1);
    assert_eq!(got.header, header);
    assert_eq!(got.data, payload);
    close(ep, &[&a, &b]);
}

#[test]
fn status_strings_and_pointer_macros() {
    let s = unsafe { CStr::from_ptr(ffi::ucs_status_string(ffi::ucs_status_t::UCS_ERR_NO_MEMORY)) };
    assert_eq!(s.to_str().unwrap(), "Out of memory");
    let err = ffi::ucs_status_t::UCS_ERR_IO_ERROR.0 as isize as *mut c_void;
    assert_eq!(unsafe { ffi::kvx_ucs_ptr_is_err(err) }, 1);
    assert_eq!(
        unsafe { ffi::kvx_ucs_ptr_raw_status(err) },
        ffi::ucs_status_t::UCS_ERR_IO_ERROR
    );
    assert_eq!(
        unsafe { ffi::kvx_ucs_ptr_status(ptr::null()) },
        ffi::ucs_status_t::UCS_OK
    );
    let mut x = 0u64;
    let real = &mut x as *mut u64 as *const c_void;
    assert_eq!(unsafe { ffi::kvx_ucs_ptr_is_ptr(real) }, 1);
    assert_eq!(
        unsafe { ffi::kvx_ucs_ptr_status(real) },
        ffi::ucs_status_t::UCS_INPROGRESS
    );
}
