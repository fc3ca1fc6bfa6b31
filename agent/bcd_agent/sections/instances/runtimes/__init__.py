"""Instance runtimes behind one small interface (`base.Runtime`): libvirt-kvm (libvirt.py, its domain
XML in domainxml.py) and cloud-hypervisor under the helper (cloudhypervisor.py, its API client in
chapi.py; the unit and record in bcd_shared.chunit/chrecord). bcx plugin runtimes are not built yet."""
