//! The C ABI of the function library (`include/stitch_nf.h`), so that functions in C or any
//! language with a C FFI can attach. It wraps [`crate::client::Function`] one to one.

use crate::client::{Function, Verdict};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(e: impl ToString) {
    let msg = CString::new(e.to_string().replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = msg);
}

/// `int callback(uint8_t *frame, uint32_t len, void *user)`: 0 forwards, anything else drops.
pub type Callback = extern "C" fn(*mut u8, u32, *mut c_void) -> c_int;

fn verdict(cb: Callback, frame: &mut [u8], user: *mut c_void) -> Verdict {
    if cb(frame.as_mut_ptr(), frame.len() as u32, user) == 0 {
        Verdict::Forward
    } else {
        Verdict::Drop
    }
}

/// Attaches to `port` through `socket`; NULL on failure (see `stitch_nf_last_error`).
///
/// # Safety
/// `socket` and `port` must be NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn stitch_nf_attach(
    socket: *const c_char,
    port: *const c_char,
) -> *mut Function {
    if socket.is_null() || port.is_null() {
        set_error("socket and port must not be NULL");
        return std::ptr::null_mut();
    }
    // SAFETY: both are non-null (checked above) NUL-terminated strings (the caller's contract).
    let (socket, port) = unsafe { (CStr::from_ptr(socket), CStr::from_ptr(port)) };
    let (Ok(socket), Ok(port)) = (socket.to_str(), port.to_str()) else {
        set_error("socket and port must be UTF-8");
        return std::ptr::null_mut();
    };
    match Function::attach(socket, port) {
        Ok(f) => Box::into_raw(Box::new(f)),
        Err(e) => {
            set_error(e);
            std::ptr::null_mut()
        }
    }
}

/// Handles up to `max` waiting packets; returns how many, or -1 on error.
///
/// # Safety
/// `f` must come from `stitch_nf_attach`.
#[no_mangle]
pub unsafe extern "C" fn stitch_nf_poll(
    f: *mut Function,
    max: c_uint,
    cb: Callback,
    user: *mut c_void,
) -> c_int {
    // SAFETY: `f` is null or a live Function from `stitch_nf_attach` (the caller's contract).
    let Some(f) = (unsafe { f.as_mut() }) else {
        return -1;
    };
    match f.poll(max as usize, |frame| verdict(cb, frame, user)) {
        Ok(n) => n as c_int,
        Err(e) => {
            set_error(e);
            -1
        }
    }
}

/// Sleeps until packets wait (blocking ports); 0, or -1 when Stitch closed the port.
///
/// # Safety
/// `f` must come from `stitch_nf_attach`.
#[no_mangle]
pub unsafe extern "C" fn stitch_nf_wait(f: *mut Function) -> c_int {
    // SAFETY: as in `stitch_nf_poll`.
    let Some(f) = (unsafe { f.as_mut() }) else {
        return -1;
    };
    match f.wait() {
        Ok(()) => 0,
        Err(e) => {
            set_error(e);
            -1
        }
    }
}

/// Serves packets until Stitch closes the port: 0, or -1 on error.
///
/// # Safety
/// `f` must come from `stitch_nf_attach`.
#[no_mangle]
pub unsafe extern "C" fn stitch_nf_run(f: *mut Function, cb: Callback, user: *mut c_void) -> c_int {
    // SAFETY: as in `stitch_nf_poll`.
    let Some(f) = (unsafe { f.as_mut() }) else {
        return -1;
    };
    match f.run(|frame| verdict(cb, frame, user)) {
        Ok(()) => 0,
        Err(e) => {
            set_error(e);
            -1
        }
    }
}

/// 1 when the port is blocking (sleep with `stitch_nf_wait`), 0 when polling.
///
/// # Safety
/// `f` must come from `stitch_nf_attach`.
#[no_mangle]
pub unsafe extern "C" fn stitch_nf_is_blocking(f: *const Function) -> c_int {
    // SAFETY: as in `stitch_nf_poll`.
    (unsafe { f.as_ref() }).is_some_and(Function::is_blocking) as c_int
}

/// Detaches and frees `f`.
///
/// # Safety
/// `f` must come from `stitch_nf_attach` and not be used afterwards.
#[no_mangle]
pub unsafe extern "C" fn stitch_nf_detach(f: *mut Function) {
    if !f.is_null() {
        // SAFETY: `f` came from `Box::into_raw` in `stitch_nf_attach` and is not used again
        // (the caller's contract).
        drop(unsafe { Box::from_raw(f) });
    }
}

/// The last error of this thread, as text (valid until the next call that fails).
#[no_mangle]
pub extern "C" fn stitch_nf_last_error() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}
