"""Instance runtimes behind one small interface (`base.Runtime`): libvirt-kvm today (libvirt.py,
its domain XML in domainxml.py). cloud-hypervisor and bcx plugin runtimes are not built yet."""
