//! Small helpers about Linux network interfaces shared by the interface apps, with errors that
//! say what to do.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use stitch_wire::ethertype;

/// The index of interface `name`.
pub fn ifindex(name: &str) -> Result<u32, String> {
    let c =
        CString::new(name).map_err(|_| format!("interface name `{name}` contains a NUL byte"))?;
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(format!(
            "`{name}` is not a valid interface name (1..15 characters)"
        ));
    }
    // SAFETY: `c` is a NUL-terminated string alive for the call.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => Err(format!("no interface named `{name}` (see `ip link show`)")),
        i => Ok(i),
    }
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is a C struct of bytes and a union of integers; all zeroes is a valid value.
    let mut r: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in r.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    r
}

fn ioctl_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socket returned a new descriptor (checked above) that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Interface flags (IFF_UP, ...).
pub fn flags(name: &str) -> io::Result<libc::c_int> {
    let s = ioctl_socket()?;
    let mut r = ifreq(name);
    // SAFETY: SIOCGIFFLAGS writes one ifreq into `r`, which is live.
    if unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCGIFFLAGS, &mut r) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS filled the union's flags member.
    Ok(unsafe { r.ifr_ifru.ifru_flags } as libc::c_int)
}

/// Sets the interface up.
pub fn set_up(name: &str) -> io::Result<()> {
    let s = ioctl_socket()?;
    let mut r = ifreq(name);
    // SAFETY: SIOCGIFFLAGS writes one ifreq into `r`, which is live.
    if unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCGIFFLAGS, &mut r) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS filled the union's flags member (a plain integer).
    unsafe { r.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads one ifreq from `r`.
    if unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFFLAGS, &r) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Interface MTU.
pub fn mtu(name: &str) -> io::Result<usize> {
    let s = ioctl_socket()?;
    let mut r = ifreq(name);
    // SAFETY: SIOCGIFMTU writes one ifreq into `r`, which is live.
    if unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCGIFMTU, &mut r) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFMTU filled the union's mtu member.
    Ok(unsafe { r.ifr_ifru.ifru_mtu } as usize)
}

/// The longest frame `interface` takes: its MTU and an Ethernet header (no limit when the MTU
/// cannot be read; the kernel's refusal is then the only check).
pub fn max_frame(interface: &str) -> usize {
    max_frame_or(interface, usize::MAX)
}

/// [`max_frame`], or `known` when the MTU cannot be read now — a TAP device moved into another
/// namespace keeps the limit it had when it left.
pub fn max_frame_or(interface: &str, known: usize) -> usize {
    mtu(interface).map_or(known, |mtu| mtu + ETH_HEADER)
}

const ETH_HEADER: usize = 14;
const VLAN_TAG: usize = 4;

/// Whether a frame (not a GSO super-frame) is longer than an interface whose longest frame is
/// `max_frame` takes; one VLAN tag rides on top of the MTU, as on the wire.
pub fn frame_too_big(frame: &[u8], max_frame: usize) -> bool {
    if frame.len() <= max_frame {
        return false;
    }
    let tagged =
        (frame.get(12..14)).is_some_and(|t| ethertype::is_vlan(u16::from_be_bytes([t[0], t[1]])));
    !tagged || frame.len() > max_frame + VLAN_TAG
}

/// Explains an error of a privileged network call.
pub fn explain(what: &str, e: io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => format!(
            "{what}: {e} — needs CAP_NET_RAW and CAP_NET_ADMIN (run as root, or \
             `setcap cap_net_raw,cap_net_admin+ep $(which stitch)`)"
        ),
        _ => format!("{what}: {e}"),
    }
}

/// The address family of socket `fd` (`SO_DOMAIN`): what a descriptor handed over at an
/// upgrade is checked against before it is used.
pub fn socket_domain(fd: RawFd) -> io::Result<i32> {
    let mut domain: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `domain`, a live c_int, and `len`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_DOMAIN,
            &mut domain as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(domain)
    }
}

/// `setsockopt` with a plain value.
pub fn setsockopt<T>(fd: RawFd, level: i32, opt: i32, v: &T) -> io::Result<()> {
    // SAFETY: the kernel reads size_of::<T>() bytes from `v`, a live reference.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            v as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as u32,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Runs `f` on a thread of its own inside network namespace `name` (a file under
/// `/var/run/netns`, as `ip netns add` makes, or a path): devices it creates and sockets it
/// opens belong to that namespace, and the process stays where it is.
pub fn in_namespace<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    let path = if name.contains('/') {
        name.to_string()
    } else {
        format!("/var/run/netns/{name}")
    };
    let ns = std::fs::File::open(&path).map_err(|e| {
        format!("cannot open network namespace `{name}` ({path}: {e}); create it with `ip netns add {name}`")
    })?;
    std::thread::spawn(move || {
        // SAFETY: a namespace file descriptor; setns changes only this thread's namespace,
        // and the thread ends with `f`.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(format!(
                "cannot enter network namespace {path}: {}",
                io::Error::last_os_error()
            ));
        }
        f()
    })
    .join()
    .map_err(|_| "the thread entering the namespace panicked".to_string())?
}

/// Sets the interface's MAC address.
pub fn set_mac(name: &str, mac: [u8; 6]) -> io::Result<()> {
    let s = ioctl_socket()?;
    let mut r = ifreq(name);
    // SAFETY: writing the sockaddr member of the union, plain bytes.
    unsafe {
        r.ifr_ifru.ifru_hwaddr.sa_family = libc::ARPHRD_ETHER;
        for (d, b) in r.ifr_ifru.ifru_hwaddr.sa_data.iter_mut().zip(mac) {
            *d = b as libc::c_char;
        }
    }
    // SAFETY: SIOCSIFHWADDR reads one ifreq from `r`, which is live.
    if unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFHWADDR, &r) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the interface's MTU.
pub fn set_mtu(name: &str, mtu: usize) -> io::Result<()> {
    let s = ioctl_socket()?;
    let mut r = ifreq(name);
    r.ifr_ifru.ifru_mtu = mtu as libc::c_int;
    // SAFETY: SIOCSIFMTU reads one ifreq from `r`, which is live.
    if unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFMTU, &r) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Gives the interface address `addr` with a prefix of `len` bits, IPv4 or IPv6.
pub fn add_address(name: &str, addr: std::net::IpAddr, len: u8) -> io::Result<()> {
    match addr {
        std::net::IpAddr::V4(a) => {
            let s = ioctl_socket()?;
            let set = |req: libc::c_ulong, v: std::net::Ipv4Addr| {
                let mut r = ifreq(name);
                // SAFETY: sockaddr_in fits in the union's sockaddr member; plain data.
                unsafe {
                    let sin =
                        &mut r.ifr_ifru.ifru_addr as *mut libc::sockaddr as *mut libc::sockaddr_in;
                    (*sin).sin_family = libc::AF_INET as libc::sa_family_t;
                    (*sin).sin_addr.s_addr = u32::from(v).to_be();
                }
                // SAFETY: the ioctl reads one ifreq from `r`, which is live.
                if unsafe { libc::ioctl(s.as_raw_fd(), req, &r) } < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            };
            set(libc::SIOCSIFADDR, a)?;
            let mask = u32::MAX.checked_shl(32 - len as u32).unwrap_or(0);
            set(libc::SIOCSIFNETMASK, mask.into())
        }
        std::net::IpAddr::V6(a) => {
            // SAFETY: socket takes no pointers.
            let fd =
                unsafe { libc::socket(libc::AF_INET6, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: a new descriptor nothing else owns.
            let s = unsafe { OwnedFd::from_raw_fd(fd) };
            /// `struct in6_ifreq` (linux/ipv6.h).
            #[repr(C)]
            struct In6Ifreq {
                addr: [u8; 16],
                prefixlen: u32,
                ifindex: libc::c_int,
            }
            let r = In6Ifreq {
                addr: a.octets(),
                prefixlen: len as u32,
                ifindex: ifindex(name).map_err(io::Error::other)? as libc::c_int,
            };
            // SAFETY: SIOCSIFADDR on an IPv6 socket reads one in6_ifreq from `r`, live.
            if unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCSIFADDR, &r) } < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        }
    }
}
