//! One message with file descriptors over a Unix stream socket (SCM_RIGHTS), and who is at the
//! other end of one (`SO_PEERCRED`).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Most descriptors one message may carry (a vhost-user memory table has up to 8).
pub const MAX_FDS: usize = 8;

/// Sends `bytes` with `fds` attached.
pub fn send(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    send_flags(sock, bytes, fds, 0)
}

/// [`send`] with extra `sendmsg` flags (`MSG_DONTWAIT` for a peer that may not be reading).
pub fn send_flags(sock: RawFd, bytes: &[u8], fds: &[RawFd], flags: i32) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS);
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
    let mut control = vec![0u8; space.max(1)];
    // SAFETY: msghdr is a C struct of integers and pointers, for which all zeroes is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space;
        // SAFETY: `control` holds CMSG_SPACE(fds) bytes, so CMSG_FIRSTHDR points at a header
        // inside it with room for the header and every descriptor after CMSG_DATA.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c) as *mut RawFd,
                fds.len(),
            );
        }
    }
    // SAFETY: `msg` points at `iov` (over `bytes`) and `control`, all alive for the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != bytes.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short send"));
    }
    Ok(())
}

/// Receives one message of at most `max` bytes and the descriptors that came with it.
pub fn recv(sock: RawFd, max: usize) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; max];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: msghdr is a C struct of integers and pointers, for which all zeroes is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space;
    // SAFETY: `msg` points at `iov` (over `buf`) and `control`, both as long as it says and
    // alive for the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel wrote well-formed control headers into `control` and set
    // msg_controllen to their extent; CMSG_FIRSTHDR/CMSG_NXTHDR stay inside it and return null
    // at its end. Each SCM_RIGHTS descriptor is new in this process and owned by nobody else.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let count =
                    ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(*data.add(i)));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "too many descriptors",
        ));
    }
    buf.truncate(n as usize);
    Ok((buf, fds))
}

/// The process at the other end of a connection, as the kernel saw it connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// Who connected on `stream`; `None` if the kernel cannot say (never for a Unix socket).
pub fn peer_cred(stream: &std::os::unix::net::UnixStream) -> Option<Cred> {
    // SAFETY: ucred is three integers; zero is a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes (ucred's size) into `cred`.
    let r = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(stream),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    (r == 0).then_some(Cred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}
