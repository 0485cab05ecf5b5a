"""Attacks on linux-cp's doors, run inside the control plane's namespace.

  attack.py tap NAME          try to attach to the existing TAP NAME; prints the errno's name
  attack.py send PORT IFINDEX send a forged RTM_NEWROUTE (198.51.100.0/24 dev IFINDEX) to
                              netlink port PORT; prints "sent" or the errno's name
  attack.py port PID          the netlink port of PID's route socket that listens to groups
"""
import errno
import fcntl
import os
import socket
import struct
import sys

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
RTM_NEWROUTE = 24
NLM_F_REQUEST = 1
NLM_F_CREATE = 0x400


def tap(name):
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
        print("attached")
    except OSError as e:
        print(errno.errorcode[e.errno])


def send(port, ifindex):
    rtmsg = struct.pack("BBBBBBBBI", socket.AF_INET, 24, 0, 0, 254, 4, 0, 1, 0)
    dst = struct.pack("HH4s", 8, 1, socket.inet_aton("198.51.100.0"))
    oif = struct.pack("HHI", 8, 4, ifindex)
    body = rtmsg + dst + oif
    msg = struct.pack("IHHII", 16 + len(body), RTM_NEWROUTE, NLM_F_REQUEST | NLM_F_CREATE, 1, 0) + body
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    try:
        s.sendto(msg, (port, 0))
        print("sent")
    except OSError as e:
        print(errno.errorcode[e.errno])


def port(pid):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    with open("/proc/net/netlink") as f:
        next(f)
        for line in f:
            w = line.split()
            # sk Eth Pid Groups Rmem Wmem Dump Locks Drops Inode
            if w[1] == "0" and int(w[3], 16) != 0 and w[9] in inodes:
                print(w[2])
                return
    sys.exit("no route socket listening to groups")


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "tap":
        tap(sys.argv[2])
    elif what == "send":
        send(int(sys.argv[2]), int(sys.argv[3]))
    else:
        port(sys.argv[2])
